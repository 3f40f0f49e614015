{{/* Names: <release>-kvgrid unless the release name already contains the chart name. */}}
{{- define "kvgrid.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgrid.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvgrid.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvgrid
{{ include "kvgrid.selectorLabels" . }}
{{- end }}

{{/* The chart's selector, or a component's with (dict "root" $ "component" "worker"). */}}
{{- define "kvgrid.selectorLabels" -}}
{{- $root := .root | default . -}}
app.kubernetes.io/name: {{ include "kvgrid.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "kvgrid.componentLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvgrid
{{ include "kvgrid.selectorLabels" . }}
{{- end }}

{{- define "kvgrid.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvgrid.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Call with (dict "root" $ "image" .Values.worker.image). */}}
{{- define "kvgrid.image" -}}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion }}
{{- if .root.Values.image.registry }}
{{- printf "%s/%s:%s" .root.Values.image.registry .image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/* In-cluster DNS names the services use to find each other. */}}
{{- define "kvgrid.schedulerHost" -}}
{{ include "kvgrid.fullname" . }}-scheduler.{{ .Release.Namespace }}.svc.cluster.local
{{- end }}

{{/* Worker pod <index> of the StatefulSet, through its headless Service: stable across restarts. */}}
{{- define "kvgrid.workerAddr" -}}
{{ include "kvgrid.fullname" .root }}-worker-{{ .index }}.{{ include "kvgrid.fullname" .root }}-worker.{{ .root.Release.Namespace }}.svc.cluster.local:{{ .root.Values.worker.ports.grpc }}
{{- end }}

{{/* Environment every kvgrid container shares; call with (dict "root" $ "values" .Values.worker). */}}
{{- define "kvgrid.commonEnv" -}}
- name: KVGRID_HOST
  value: "0.0.0.0"
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRITON_CACHE_DIR
  value: /tmp/triton
- name: HF_HOME
  value: /tmp/hf
- name: OTEL_SERVICE_NAME
  value: kvgrid-{{ .component }}
{{- range $key, $value := .root.Values.otel }}
- name: {{ $key }}
  value: {{ $value | quote }}
{{- end }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvgrid.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* startup, readiness and liveness probes of a component's values; (dict "root" $ "component" "worker" "values" $v)
     (see kvgrid.probe for probes on ports under TLS) */}}
{{- define "kvgrid.probes" -}}
{{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{ $kind }}:
  {{- include "kvgrid.probe" (merge (dict "probe" (index $.values $kind)) $) | nindent 2 }}
{{- end }}
{{- end }}

{{- define "kvgrid.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* KVGRID_SHUTDOWN_GRACE (rounded up) + the tokenizer's preStop sleep + 10 s to close: the same for every pod,
     so that a pod is never killed while it drains. */}}
{{- define "kvgrid.terminationGracePeriodSeconds" -}}
{{- $grace := .Values.config.KVGRID_SHUTDOWN_GRACE | default "30" | float64 | ceil | int -}}
{{- add $grace (.Values.tokenizer.preStopSleepSeconds | default 0 | int) 10 -}}
{{- end }}
