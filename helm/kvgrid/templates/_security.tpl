{{/* API keys, certificates and their mounts: what each service's KVGRID_* security settings point at. */}}

{{/* The Secret holding the API keys under `api-keys`; empty when no key is asked for. */}}
{{- define "kvgrid.apiKeysSecret" -}}
{{- $auth := .Values.auth -}}
{{- if and $auth.existingSecret $auth.apiKeys -}}
{{- fail "auth: set existingSecret or apiKeys, not both" -}}
{{- end -}}
{{- if $auth.existingSecret -}}
{{- $auth.existingSecret -}}
{{- else if $auth.apiKeys -}}
{{- include "kvgrid.fullname" . }}-api-keys
{{- end -}}
{{- end }}

{{- define "kvgrid.publicTLSSecret" -}}
{{- .Values.tls.public.secretName | default (printf "%s-tokenizer-tls" (include "kvgrid.fullname" .)) -}}
{{- end }}

{{/* Call with (dict "root" $ "component" "worker"). */}}
{{- define "kvgrid.internalTLSSecret" -}}
{{- index .root.Values.tls.internal.secretNames .component | default (printf "%s-%s-internal-tls" (include "kvgrid.fullname" .root) .component) -}}
{{- end }}

{{/* "true" when the component's gRPC port speaks TLS: the tokenizer's public one, the others' internal one. */}}
{{- define "kvgrid.grpcTLS" -}}
{{- if eq .component "tokenizer" -}}
{{- if .root.Values.tls.public.enabled }}true{{ end -}}
{{- else if .root.Values.tls.internal.enabled }}true{{ end -}}
{{- end }}

{{/* KVGRID_* variables naming the mounted key and certificate files; (dict "root" $ "component" "tokenizer"). */}}
{{- define "kvgrid.securityEnv" -}}
{{- $root := .root -}}
{{- if eq .component "tokenizer" }}
{{- if include "kvgrid.apiKeysSecret" $root }}
- name: KVGRID_API_KEY_FILE
  value: /etc/kvgrid/auth/api-keys
{{- end }}
{{- if $root.Values.auth.metricsRequireKey }}
{{- if not (include "kvgrid.apiKeysSecret" $root) }}
{{- fail "auth.metricsRequireKey needs API keys (auth.existingSecret or auth.apiKeys)" }}
{{- end }}
- name: KVGRID_METRICS_REQUIRE_KEY
  value: "true"
{{- end }}
{{- with $root.Values.tls.public }}
{{- if .enabled }}
- name: KVGRID_TLS_CERT_FILE
  value: /etc/kvgrid/tls/public/tls.crt
- name: KVGRID_TLS_KEY_FILE
  value: /etc/kvgrid/tls/public/tls.key
{{- if .clientAuth }}
- name: KVGRID_TLS_CA_FILE
  value: {{ ternary "/etc/kvgrid/tls/client-ca/ca.crt" "/etc/kvgrid/tls/public/ca.crt" (not (empty .clientCASecret)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if $root.Values.tls.internal.enabled }}
- name: KVGRID_INTERNAL_TLS_CA
  value: /etc/kvgrid/tls/internal/ca.crt
- name: KVGRID_INTERNAL_TLS_CERT
  value: /etc/kvgrid/tls/internal/tls.crt
- name: KVGRID_INTERNAL_TLS_KEY
  value: /etc/kvgrid/tls/internal/tls.key
{{- end }}
{{- end }}

{{/* The Secrets behind those files, read-only (mode 0440: root and the pod's fsGroup). Whole Secrets, never
     subPath, so that renewed certificates reach the files. */}}
{{- define "kvgrid.securityVolumeMounts" -}}
{{- $root := .root -}}
{{- if eq .component "tokenizer" }}
{{- if include "kvgrid.apiKeysSecret" $root }}
- name: api-keys
  mountPath: /etc/kvgrid/auth
  readOnly: true
{{- end }}
{{- if $root.Values.tls.public.enabled }}
- name: tls-public
  mountPath: /etc/kvgrid/tls/public
  readOnly: true
{{- if and $root.Values.tls.public.clientAuth $root.Values.tls.public.clientCASecret }}
- name: tls-client-ca
  mountPath: /etc/kvgrid/tls/client-ca
  readOnly: true
{{- end }}
{{- end }}
{{- end }}
{{- if $root.Values.tls.internal.enabled }}
- name: tls-internal
  mountPath: /etc/kvgrid/tls/internal
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvgrid.securityVolumes" -}}
{{- $root := .root -}}
{{- if eq .component "tokenizer" }}
{{- with include "kvgrid.apiKeysSecret" $root }}
- name: api-keys
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: api-keys
        path: api-keys
{{- end }}
{{- if $root.Values.tls.public.enabled }}
- name: tls-public
  secret:
    secretName: {{ include "kvgrid.publicTLSSecret" $root }}
    defaultMode: 0440
{{- if and $root.Values.tls.public.clientAuth $root.Values.tls.public.clientCASecret }}
- name: tls-client-ca
  secret:
    secretName: {{ $root.Values.tls.public.clientCASecret }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- if $root.Values.tls.internal.enabled }}
- name: tls-internal
  secret:
    secretName: {{ include "kvgrid.internalTLSSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* A changed key Secret of the chart's own restarts the tokenizer pods (a digest, never the keys). */}}
{{- define "kvgrid.securityAnnotations" -}}
{{- if and (eq .component "tokenizer") (not .root.Values.auth.existingSecret) .root.Values.auth.apiKeys }}
checksum/api-keys: {{ include (print .root.Template.BasePath "/api-keys-secret.yaml") .root | sha256sum }}
{{- end }}
{{- if and (eq .component "tokenizer") .root.Values.tls.public.enabled }}
prometheus.io/scheme: https
{{- end }}
{{- end }}

{{/* One probe of a component: (dict "root" $ "component" "worker" "values" $v "probe" $v.readinessProbe).
     The kubelet's gRPC probe speaks plaintext only, so on a gRPC port under TLS a gRPC probe becomes: for the
     tokenizer, GET /health over HTTPS on its HTTP port (a TCP check when clients must show a certificate, which
     the kubelet has none of); for the scheduler and the worker, the gRPC health check run inside the pod
     (python -m kvgrid.cli.healthcheck), which dials with the pod's own internal certificate. */}}
{{- define "kvgrid.probe" -}}
{{- $probe := .probe -}}
{{- if and (hasKey $probe "grpc") (include "kvgrid.grpcTLS" .) -}}
{{- $probe = omit $probe "grpc" -}}
{{- if ne .component "tokenizer" -}}
{{- $command := list "python" "-m" "kvgrid.cli.healthcheck" (printf "localhost:%v" .values.ports.grpc) -}}
{{- $timeout := max 5 (int ($probe.timeoutSeconds | default 1)) -}}
{{- $probe = merge (dict "exec" (dict "command" $command) "timeoutSeconds" $timeout) $probe -}}
{{- else if .root.Values.tls.public.clientAuth -}}
{{- $probe = merge (dict "tcpSocket" (dict "port" "grpc")) $probe -}}
{{- else -}}
{{- $probe = merge (dict "httpGet" (dict "path" "/health" "port" "http" "scheme" "HTTPS")) $probe -}}
{{- end -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end }}

{{/* NetworkPolicy peers: this release's pods of a component, (dict "root" $ "component" "scheduler") */}}
{{- define "kvgrid.np.pods" -}}
- podSelector:
    matchLabels:
      {{- include "kvgrid.selectorLabels" . | nindent 6 }}
{{- end }}

{{/* ... and the Prometheus of networkPolicy.prometheus (no namespaceSelector: this namespace only) */}}
{{- define "kvgrid.np.prometheus" -}}
- podSelector:
    {{- toYaml (.prometheus.podSelector | default dict) | nindent 4 }}
  {{- if and (hasKey .prometheus "namespaceSelector") (kindIs "map" .prometheus.namespaceSelector) }}
  namespaceSelector:
    {{- toYaml .prometheus.namespaceSelector | nindent 4 }}
  {{- end }}
{{- end }}
