"""`spec.podOverrides.affinity`: a pod's affinity, typed as Kubernetes types it (core/v1 `Affinity`).

It was an open object, passed to the pods as given. A misspelt rule (`requiredDuringScheduling`, a
`nodeSelectorTerms` entry without its list) then reached the API server, which drops fields it does not
know from a pod and refuses values it finds invalid: the job's pods were either placed without the rule the
user meant, or refused (`PodsRefused`) after the job existed, when only deleting and applying it again
helps. Typed, a bad affinity is refused at apply time with its field named, the CRD tells `kubectl explain`
every field, and the CRD's immutability rule keeps a bounded cost: every list and map here has a bound, small
beside Kubernetes' (none), larger than an affinity a training job writes.

The checks are the API server's own (`ValidateAffinity`): operators and their values (In and NotIn need
values, Exists and DoesNotExist none, Gt and Lt one integer), label keys and values, weights 1-100, a
topology key on every pod affinity term, node selector terms with at least one requirement.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import names

Key = Annotated[str, StringConstraints(min_length=1, max_length=316)]
Value = Annotated[str, StringConstraints(max_length=63)]
Values = Annotated[list[Value], Field(max_length=32)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


def _key(key: str) -> str:
    if not names.is_qualified_name(key):
        raise ValueError(f"key: {key!r} is not a valid label key")
    return key


def _values_for(operator: str, values: list[str], *, numbers: bool) -> None:
    if operator in ("In", "NotIn") and not values:
        raise ValueError(f"values: {operator} needs at least one value")
    if operator in ("Exists", "DoesNotExist") and values:
        raise ValueError(f"values: must be empty with {operator}")
    if operator in ("Gt", "Lt") and (len(values) != 1 or not values[0].lstrip("-").isdigit()):
        raise ValueError(f"values: {operator} takes one integer, got {values}")
    if not numbers:
        for value in values:
            if names.label_value_errors(value):
                raise ValueError(f"values: {value!r} is not a valid label value")


class LabelSelectorRequirement(_Model):
    """A requirement on pods' labels."""

    key: Key = Field(description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: Values = Field(default_factory=list, description="Label values (In and NotIn only).")

    @model_validator(mode="after")
    def _consistent(self) -> LabelSelectorRequirement:
        _key(self.key)
        _values_for(self.operator, self.values, numbers=False)
        return self


class LabelSelector(_Model):
    """Pods (or namespaces) by their labels; empty: all of them."""

    match_labels: dict[str, Value] = Field(
        default_factory=dict, max_length=8, description="Labels they carry, all of them."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=8, description="Requirements they meet, all of them."
    )

    @field_validator("match_labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        error = names.label_map_error(labels, "label", values=True)
        if error:
            raise ValueError(error)
        return labels


class NodeSelectorRequirement(_Model):
    """A requirement on nodes' labels (or, in `matchFields`, on the node's name)."""

    key: Key = Field(description="The node label key (matchFields: metadata.name).")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt."
    )
    values: Values = Field(
        default_factory=list, description="Values (In and NotIn: some; Gt and Lt: one integer)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> NodeSelectorRequirement:
        _key(self.key)
        _values_for(self.operator, self.values, numbers=self.operator in ("Gt", "Lt"))
        return self


class NodeSelectorTerm(_Model):
    """Nodes that meet every requirement of the term."""

    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=8, description="Requirements on the node's labels."
    )
    match_fields: list[NodeSelectorRequirement] = Field(
        default_factory=list, max_length=4, description="Requirements on the node's fields (metadata.name)."
    )

    @model_validator(mode="after")
    def _fields(self) -> NodeSelectorTerm:
        for index, field in enumerate(self.match_fields):
            if field.key != "metadata.name" or field.operator not in ("In", "NotIn"):
                raise ValueError(f"matchFields.{index}: only metadata.name, with In or NotIn")
        return self


class NodeSelector(_Model):
    """Nodes that meet any of the terms."""

    node_selector_terms: list[NodeSelectorTerm] = Field(
        min_length=1, max_length=8, description="Terms, any of which a node meets."
    )

    @model_validator(mode="after")
    def _not_empty(self) -> NodeSelector:
        for index, term in enumerate(self.node_selector_terms):
            if not term.match_expressions and not term.match_fields:
                raise ValueError(f"nodeSelectorTerms.{index}: give matchExpressions or matchFields")
        return self


class PreferredSchedulingTerm(_Model):
    """Nodes the scheduler prefers, by weight."""

    weight: int = Field(ge=1, le=100, description="1-100: how much a matching node is preferred.")
    preference: NodeSelectorTerm = Field(description="The nodes preferred.")


class NodeAffinity(_Model):
    """Which nodes the pods run on."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes the pods must run on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=8, description="Nodes the pods prefer."
    )


class PodAffinityTerm(_Model):
    """Pods (by labels, in namespaces) whose topology domain (node, zone, rack) the pods join or avoid."""

    label_selector: LabelSelector | None = Field(default=None, description="The other pods, by labels.")
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Their namespaces, by labels; with `namespaces`, either matches."
    )
    namespaces: list[Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=list, max_length=8, description="Their namespaces; none: the job's."
    )
    topology_key: Key = Field(description="The node label whose value is the domain (e.g. a zone's).")
    match_label_keys: list[Key] = Field(
        default_factory=list, max_length=8, description="Label keys whose values the other pods share."
    )
    mismatch_label_keys: list[Key] = Field(
        default_factory=list, max_length=8, description="Label keys whose values the other pods differ in."
    )

    @model_validator(mode="after")
    def _keys(self) -> PodAffinityTerm:
        if not names.is_qualified_name(self.topology_key):
            raise ValueError(f"topologyKey: {self.topology_key!r} is not a valid label key")
        keys = {"matchLabelKeys": self.match_label_keys, "mismatchLabelKeys": self.mismatch_label_keys}
        for field, given in keys.items():
            for key in given:
                if not names.is_qualified_name(key):
                    raise ValueError(f"{field}: {key!r} is not a valid label key")
        both = set(self.match_label_keys) & set(self.mismatch_label_keys)
        if both:
            raise ValueError(f"matchLabelKeys and mismatchLabelKeys both name {sorted(both)}")
        for namespace in self.namespaces:
            if names.label_errors(namespace):
                raise ValueError(f"namespaces: {namespace!r} is not a namespace name")
        return self


class WeightedPodAffinityTerm(_Model):
    """A pod affinity term the scheduler prefers, by weight."""

    weight: int = Field(ge=1, le=100, description="1-100: how much meeting the term is preferred.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(_Model):
    """Pods the job's pods run beside (podAffinity) or away from (podAntiAffinity)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=8, description="Terms the pods must meet."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=8, description="Terms the pods prefer to meet."
    )


class Affinity(_Model):
    """A pod's `spec.affinity`, as Kubernetes types it."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Which nodes the pods run on.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Pods they run beside.")
    pod_anti_affinity: PodAffinity | None = Field(default=None, description="Pods they run away from.")

    def manifest(self) -> dict[str, Any]:
        """The pod's `spec.affinity`, with what was not given left out (as a user would write it)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
