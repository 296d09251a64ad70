"""Protobuf request bodies in the local API server. kubectl's typed commands (`kubectl create namespace`,
`create secret`, `create configmap`) send their object in Kubernetes' protobuf encoding, as kube-apiserver
accepts for every built-in kind; `kubectl apply -f` sends JSON. This reads that encoding for the built-in
kinds those commands create and gives the object a JSON body would have given: the same field names, bytes
as base64, empty fields left out. Any other kind sent as protobuf is a 415 that says to send JSON.

The encoding: the bytes `k8s\\0`, then a `runtime.Unknown` message holding the TypeMeta (apiVersion, kind)
and the object's own message (`raw`). Field numbers are those of k8s.io/api's generated.proto."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from typing import Any, Union

MAGIC = b"k8s\x00"


class ProtobufError(ValueError):
    """A body that is not a Kubernetes protobuf object this server can read."""


# A field's type: a scalar name, a nested message, or ("map"|"list", element type).
FieldType = Union[str, "Message", tuple[str, Any]]
Message = Mapping[int, tuple[str, FieldType]]

_OWNER_REFERENCE: Message = {
    1: ("kind", "string"),
    3: ("name", "string"),
    4: ("uid", "string"),
    5: ("apiVersion", "string"),
    6: ("controller", "bool"),
    7: ("blockOwnerDeletion", "bool"),
}
_OBJECT_META: Message = {
    1: ("name", "string"),
    2: ("generateName", "string"),
    3: ("namespace", "string"),
    5: ("uid", "string"),
    6: ("resourceVersion", "string"),
    7: ("generation", "int"),
    11: ("labels", ("map", "string")),
    12: ("annotations", ("map", "string")),
    13: ("ownerReferences", ("list", _OWNER_REFERENCE)),
    14: ("finalizers", ("list", "string")),
}
KINDS: Mapping[str, Message] = {
    "Namespace": {
        1: ("metadata", _OBJECT_META),
        2: ("spec", {1: ("finalizers", ("list", "string"))}),
        3: ("status", {1: ("phase", "string")}),
    },
    "Secret": {
        1: ("metadata", _OBJECT_META),
        2: ("data", ("map", "bytes")),
        3: ("type", "string"),
        4: ("stringData", ("map", "string")),
        5: ("immutable", "bool"),
    },
    "ConfigMap": {
        1: ("metadata", _OBJECT_META),
        2: ("data", ("map", "string")),
        3: ("binaryData", ("map", "bytes")),
        4: ("immutable", "bool"),
    },
    # `kubectl create serviceaccount` (a job's spec.podOverrides.serviceAccountName must exist).
    "ServiceAccount": {
        1: ("metadata", _OBJECT_META),
        2: ("secrets", ("list", {1: ("kind", "string"), 2: ("namespace", "string"), 3: ("name", "string")})),
        3: ("imagePullSecrets", ("list", {1: ("name", "string")})),
        4: ("automountServiceAccountToken", "bool"),
    },
}
_TYPE_META: Message = {1: ("apiVersion", "string"), 2: ("kind", "string")}
_UNKNOWN: Message = {1: ("typeMeta", _TYPE_META), 2: ("raw", "bytes")}
_MAP_ENTRY_KEY, _MAP_ENTRY_VALUE = 1, 2


def decode(body: bytes) -> dict[str, Any]:
    """The JSON form of a Kubernetes protobuf body; ProtobufError if it is not one, or of a kind not in
    KINDS."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body does not start with the Kubernetes protobuf prefix")
    envelope = _message(body[len(MAGIC) :], _UNKNOWN, raw_bytes=True)
    type_meta = envelope.get("typeMeta", {})
    kind = type_meta.get("kind", "")
    schema = KINDS.get(kind)
    if schema is None:
        raise ProtobufError(f"this server reads protobuf for {', '.join(KINDS)} only, not for {kind or 'it'}")
    obj = _message(envelope.get("raw", b""), schema)
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}


def _message(data: bytes, schema: Message, raw_bytes: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in _fields(data):
        if number not in schema:
            continue  # as protobuf does: a field this reader does not know is skipped
        name, field_type = schema[number]
        if isinstance(field_type, tuple) and field_type[0] == "map":
            entry = _map_entry(_need_bytes(value, name), field_type[1])
            obj.setdefault(name, {}).update([entry])
        elif isinstance(field_type, tuple):
            obj.setdefault(name, []).append(_scalar_or_message(value, field_type[1], name))
        elif raw_bytes and field_type == "bytes":
            obj[name] = _need_bytes(value, name)
        else:
            decoded = _scalar_or_message(value, field_type, name)
            if decoded not in ("", 0) or field_type == "bool":
                obj[name] = decoded  # Go's `omitempty`: an empty string or zero is not in the JSON form
    return obj


def _map_entry(data: bytes, value_type: str) -> tuple[str, Any]:
    key, value = "", _scalar_or_message(b"", value_type, "value")
    for number, field in _fields(data):
        if number == _MAP_ENTRY_KEY:
            key = _scalar_or_message(field, "string", "key")
        elif number == _MAP_ENTRY_VALUE:
            value = _scalar_or_message(field, value_type, key)
    return key, value


def _scalar_or_message(value: int | bytes, field_type: Any, name: str) -> Any:
    if field_type in ("int", "bool"):
        if not isinstance(value, int):
            raise ProtobufError(f"field {name} is not a varint")
        number = value - (1 << 64) if value >= 1 << 63 else value
        return bool(number) if field_type == "bool" else number
    data = _need_bytes(value, name)
    if field_type == "string":
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise ProtobufError(f"field {name} is not UTF-8 text") from None
    if field_type == "bytes":
        return base64.b64encode(data).decode()
    return _message(data, field_type)


def _need_bytes(value: int | bytes, name: str) -> bytes:
    if not isinstance(value, bytes):
        raise ProtobufError(f"field {name} is not length-delimited")
    return value


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """The (field number, value) pairs of a message: varints as ints, length-delimited fields as bytes."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(data, at)
            yield number, value
        elif wire == 2:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise ProtobufError("a field runs past the end of the body")
            yield number, data[at : at + size]
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4  # fixed64/fixed32: no field of the kinds read here
        else:
            raise ProtobufError(f"wire type {wire} is not one this reader knows")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(data) or shift > 63:
            raise ProtobufError("a varint runs past the end of the body")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
