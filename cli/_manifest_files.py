"""Reading Kubernetes manifests from a YAML file for `rjob` commands: every way a file can be wrong
(unreadable, a YAML syntax error, a document that is not an object, a missing apiVersion, kind or name)
becomes one `CliError` line naming the file, the document and the field, as `kubectl apply` does; never a
traceback."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ._common import CliError


@dataclass(frozen=True, slots=True)
class Document:
    """One object of a manifest file, with where it came from for error messages."""

    path: Path
    index: int
    """1-based position of the document in the file (documents are separated by `---`)."""
    body: dict[str, Any]

    @property
    def where(self) -> str:
        """`FILE document N (kind/name)`: the prefix of every error about this object."""
        kind = str(self.body.get("kind", "")).lower()
        name = (self.body.get("metadata") or {}).get("name", "")
        return f"{self.path} document {self.index} ({kind}/{name})"


class _StrictLoader(yaml.SafeLoader):
    """YAML as kubectl reads it (sigs.k8s.io/yaml, strict): a key given twice in one mapping is an error,
    not silently the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _syntax_error(path: Path, exc: yaml.YAMLError) -> CliError:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
    detail = f"{problem} ({context})" if context else problem
    return CliError(f"{path}: invalid YAML at {where}: {detail}")


def _check(document: Document) -> Document:
    body = document.body
    for field in ("apiVersion", "kind"):
        value = body.get(field)
        if not isinstance(value, str) or not value:
            raise CliError(f"{document.path} document {document.index}: {field}: required (a string)")
    metadata = body.get("metadata")
    if not isinstance(metadata, dict):
        raise CliError(f"{document.path} document {document.index}: metadata: required (an object)")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise CliError(f"{document.path} document {document.index}: metadata.name: required (a string)")
    return document


def load_documents(path: Path) -> list[Document]:
    """The non-empty documents of a YAML file, each an object with apiVersion, kind and metadata.name."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CliError(f"filename: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        raw = list(yaml.load_all(text, Loader=_StrictLoader))
    except yaml.YAMLError as exc:
        raise _syntax_error(path, exc) from None
    documents = []
    for index, body in enumerate(raw, start=1):
        if body is None:
            continue
        if not isinstance(body, dict):
            kind = "a list" if isinstance(body, list) else f"a {type(body).__name__}"
            raise CliError(
                f"{path} document {index}: expected an object (apiVersion, kind, metadata, ...), got {kind}"
            )
        documents.append(_check(Document(path, index, body)))
    if not documents:
        raise CliError(f"{path}: no objects in the file")
    return documents
