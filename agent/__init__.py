"""resilientjob.agent: the in-pod side (telemetry, elastic launcher, training runtime, layer copy)."""
