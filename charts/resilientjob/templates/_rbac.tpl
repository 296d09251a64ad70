{{/*
The permissions the operator uses, and no more. tests/ship/test_rbac.py derives the same set from the
operator's code (statically) and from the requests the real operator makes against the emulated API server,
and fails when these rules grant anything else or miss anything.
*/}}

{{/* Per watched namespace: the objects of a job and kopf's bookkeeping on the ResilientJob itself. */}}
{{- define "resilientjob.jobRules" -}}
# The worker pods: created per node, watched for fail-stops, annotated with each new generation,
# fenced (deleted) when they fail, re-read to confirm a failure before acting on it.
- apiGroups: [""]
  resources: [pods]
  verbs: [create, delete, get, list, patch, watch]
# The headless Service that gives each worker a stable DNS name (read: is it an earlier job's, still
# being deleted?).
- apiGroups: [""]
  resources: [services]
  verbs: [create, get]
# The plan ConfigMap (created, then patched each generation) and profiles referenced by spec.profile.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, get, patch]
# The Redis password a job names in spec.redis.passwordSecretRef; read only.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# An Event for every decision and every rejected spec.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# kopf watches the jobs and keeps its finalizer and progress annotations on them; the operator writes status.
- apiGroups: [resilientjob.io]
  resources: [resilientjobs]
  verbs: [list, patch, watch]
- apiGroups: [resilientjob.io]
  resources: [resilientjobs/status]
  verbs: [patch]
{{- end -}}

{{/* kopf peering in one namespace (namespaced mode). */}}
{{- define "resilientjob.peeringRules" -}}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, patch, watch]
{{- end -}}
