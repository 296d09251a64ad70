{{/* Names, labels and the few derived values every template shares. */}}

{{- define "resilientjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "resilientjob.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "resilientjob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "resilientjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: resilientjob
{{- end -}}

{{- define "resilientjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "resilientjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "resilientjob.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "resilientjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "resilientjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "resilientjob.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "resilientjob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces whose ResilientJobs the operator runs (the release namespace when none are listed). */}}
{{- define "resilientjob.watchNamespaces" -}}
{{- if .Values.operator.watch.namespaces -}}
{{- join "," (uniq .Values.operator.watch.namespaces) -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "resilientjob.redisName" -}}
{{- printf "%s-redis" (include "resilientjob.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret and key holding the Redis password; empty name: no password. */}}
{{- define "resilientjob.redisSecretName" -}}
{{- if eq .Values.redis.mode "builtin" -}}
{{- default (include "resilientjob.redisName" .) .Values.redis.builtin.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.passwordSecret.name -}}
{{- end -}}
{{- end -}}

{{- define "resilientjob.redisSecretKey" -}}
{{- if eq .Values.redis.mode "builtin" -}}
password
{{- else -}}
{{- .Values.redis.external.passwordSecret.key -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL without credentials. */}}
{{- define "resilientjob.redisAddress" -}}
{{- if eq .Values.redis.mode "builtin" -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "resilientjob.redisName" .) .Release.Namespace -}}
{{- else -}}
{{- required "redis.external.url is required when redis.mode is external" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* The operator's default Redis URL: the password is spliced in by Kubernetes from RJOB_REDIS_PASSWORD. */}}
{{- define "resilientjob.redisUrl" -}}
{{- $address := include "resilientjob.redisAddress" . -}}
{{- if include "resilientjob.redisSecretName" . -}}
{{- $scheme := regexFind "^rediss?://" $address -}}
{{- printf "%s:$(RJOB_REDIS_PASSWORD)@%s" $scheme (trimPrefix $scheme $address) -}}
{{- else -}}
{{- $address -}}
{{- end -}}
{{- end -}}

{{/* The worker defaults handed to the operator (resolved accelerator presets merged with overrides). */}}
{{- define "resilientjob.workerDefaults" -}}
{{- $w := .Values.workers -}}
{{- $preset := dict "resourceName" "" "nodeSelector" (dict) "tolerations" (list) -}}
{{- if eq $w.accelerator "nvidia" -}}{{- $preset = $w.nvidia -}}{{- end -}}
{{- if eq $w.accelerator "ascend" -}}{{- $preset = $w.ascend -}}{{- end -}}
{{- $tolerations := concat $preset.tolerations $w.tolerations -}}
{{- if not $tolerations -}}{{- $tolerations = list -}}{{- end -}}
{{- $out := dict
    "accelerator" $w.accelerator
    "resourceName" $preset.resourceName
    "nodeSelector" (merge (dict) $w.nodeSelector $preset.nodeSelector)
    "acceleratorNodeSelector" $preset.nodeSelector
    "tolerations" $tolerations
    "affinity" $w.affinity
    "resources" $w.resources
    "priorityClassName" $w.priorityClassName
    "runtimeClassName" $w.runtimeClassName
    "shmSize" $w.shmSize
    "env" $w.env
    "podSecurityContext" $w.podSecurityContext
    "securityContext" $w.securityContext
    "redis" (include "resilientjob.workerRedis" . | fromJson) -}}
{{- toPrettyJson $out -}}
{{- end -}}

{{/* How worker pods of jobs without spec.redis reach the default Redis: the address without a password, and
the Secret that holds it (referenced by the pods, in their own namespace). */}}
{{- define "resilientjob.workerRedis" -}}
{{- $out := dict "url" (include "resilientjob.redisAddress" .) -}}
{{- if include "resilientjob.redisSecretName" . -}}
{{- $_ := set $out "passwordSecret" (dict "name" (include "resilientjob.redisSecretName" .) "key" (include "resilientjob.redisSecretKey" .)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
