"""What a `spec.model` string names, decided the same way by the operator (validation, planning) and the agent
(what to run), so that nothing falls back silently from training to a simulation.

- `synthetic:<name>`: the synthetic telemetry loop (no model, no data) following the plans made for the
  profile `<name>` (a built-in profile, or any name with `spec.profile`): scale tests of the control plane.
- `gpt`, `llama`, `sleep`: the runtime's built-in toy models (tests, demos; shapes from `--model-option`).
- `llama2-7b`, `gpt3-2.7b`, `gpt3-6.7b`: built-in profiles whose architecture the runtime trains (random
  initialisation); the planner uses the profile of the same name.
- `hf:<dir>` (a path: contains `/` or starts with `.`): a Hugging Face `save_pretrained` directory;
  `hf:<family>?key=value&...`: a Hugging Face configuration (random initialisation).
- `module:function`: the user's own ordered layer list.
Anything else is refused; `bert-large` (an encoder profile) only as `synthetic:bert-large`.
"""

from __future__ import annotations

from enum import StrEnum

SYNTHETIC_PREFIX = "synthetic:"
HF_PREFIX = "hf:"
TOY_MODELS = frozenset({"gpt", "llama", "sleep"})
TRAINABLE_PROFILES = frozenset({"llama2-7b", "gpt3-2.7b", "gpt3-6.7b"})
ENCODER_PROFILES = frozenset({"bert-large"})


class ModelSource(StrEnum):
    SYNTHETIC = "synthetic"
    TOY = "toy"
    PROFILE = "profile"
    HF_DIRECTORY = "hf-directory"
    HF_CONFIG = "hf-config"
    FUNCTION = "function"


def model_source(model: str) -> ModelSource:
    """What `model` names; ValueError (`model: ...`, one line) when it names nothing the runtime runs."""
    if model.startswith(SYNTHETIC_PREFIX):
        if not model[len(SYNTHETIC_PREFIX) :]:
            raise ValueError("model: synthetic: needs a profile name, e.g. synthetic:bert-large")
        return ModelSource.SYNTHETIC
    if model.startswith(HF_PREFIX):
        rest = model[len(HF_PREFIX) :]
        if not rest:
            raise ValueError("model: hf: needs a directory (hf:/models/llama) or a config (hf:gpt2?...)")
        return ModelSource.HF_DIRECTORY if "/" in rest or rest.startswith(".") else ModelSource.HF_CONFIG
    if model in TOY_MODELS:
        return ModelSource.TOY
    if model in TRAINABLE_PROFILES:
        return ModelSource.PROFILE
    if model in ENCODER_PROFILES:
        raise ValueError(
            f"model: {model} is an encoder profile that the runtime cannot train; write synthetic:{model} "
            "for a scale test of the control plane"
        )
    if ":" in model:
        return ModelSource.FUNCTION
    raise ValueError(
        f"model: {model!r} names no model: use hf:<dir>, hf:<family>?..., one of "
        f"{sorted(TRAINABLE_PROFILES | TOY_MODELS)}, module:function, or synthetic:<profile> for a simulation"
    )


def profile_name(model: str) -> str | None:
    """The built-in planner profile a model plans with, when it has one (synthetic:<name> or a trainable
    profile name); None when the job must give `spec.profile`."""
    if model.startswith(SYNTHETIC_PREFIX):
        return model[len(SYNTHETIC_PREFIX) :]
    return model if model in TRAINABLE_PROFILES else None
