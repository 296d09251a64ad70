"""The contract between the operator and the agents that neither side owns: what a worker is told to train.

`resilientjob.protocol` imports pydantic only. The operator embeds these types in the ResilientJob API (so the
CRD is generated from them) and hands the validated result to every worker pod as one JSON document; the
agent validates it again on arrival (nothing read from the environment is trusted).
"""

from .models import ModelSource, model_source, profile_name
from .workload import (
    DataFormat,
    DataSpec,
    OutputSpec,
    Precision,
    Schedule,
    TokenDtype,
    TrainingSpec,
    Workload,
    WorkloadCheckpoint,
    load_workload,
)

__all__ = [
    "DataFormat",
    "DataSpec",
    "ModelSource",
    "OutputSpec",
    "Precision",
    "Schedule",
    "TokenDtype",
    "TrainingSpec",
    "Workload",
    "WorkloadCheckpoint",
    "load_workload",
    "model_source",
    "profile_name",
]
