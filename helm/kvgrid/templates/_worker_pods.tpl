{{/* The pod of a worker group's rank 0 ("leader": kvgrid worker, the gRPC worker a scheduler dials) or of one of
     its other nodes (kvgrid worker-rank running `command`). Each asks for the GPUs of its ranks: the group's
     KVGRID_TENSOR_PARALLEL_SIZE x KVGRID_PIPELINE_PARALLEL_SIZE ranks, one GPU each, split over workerGroup.nodes pods.
     Call with (dict "root" $ "leader" true) or (dict "root" $ "leader" false "command" (list ...)). */}}
{{- define "kvgrid.workerPod" -}}
{{- $root := .root }}
{{- $leader := .leader }}
{{- $command := .command }}
{{- $v := $root.Values.worker }}
{{- $nodes := int $root.Values.workerGroup.nodes }}
{{- $gpus := mul (int $v.gpu.count) (int (include "kvgrid.ranksPerNode" $root)) }}
serviceAccountName: {{ include "kvgrid.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ include "kvgrid.terminationGracePeriodSeconds" $root }}
containers:
  - name: worker
    image: {{ include "kvgrid.image" (dict "root" $root "image" $v.image) }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- if $leader }}
    command: ["kvgrid", "worker"]
    {{- else }}
    {{- /* kvgrid worker-rank: this node's ranks, joined to its group's rank 0 by the rendezvous address alone */}}
    command: {{ toJson $command }}
    {{- end }}
    ports:
      {{- if $leader }}
      - name: grpc
        containerPort: {{ $v.ports.grpc }}
        protocol: TCP
      - name: metrics
        containerPort: {{ $v.ports.metrics }}
        protocol: TCP
      {{- end }}
      {{- if gt $nodes 1 }}
      {{- /* rank 0 serves the rendezvous here; the ranks' own links (gloo/NCCL, the control channel) take free ports */}}
      - name: rendezvous
        containerPort: {{ $root.Values.workerGroup.rendezvousPort }}
        protocol: TCP
      {{- end }}
    envFrom:
      - configMapRef:
          name: {{ include "kvgrid.fullname" $root }}-config
    env:
      {{- if $leader }}
      {{- if gt $nodes 1 }}
      - name: KVGRID_NNODES
        value: {{ $nodes | quote }}
      - name: KVGRID_DISTRIBUTED_INIT_METHOD
        value: "tcp://0.0.0.0:{{ $root.Values.workerGroup.rendezvousPort }}"
      {{- end }}
      - name: KVGRID_WORKER_PORT
        value: {{ $v.ports.grpc | quote }}
      - name: KVGRID_WORKER_METRICS_PORT
        value: {{ $v.ports.metrics | quote }}
      {{- with include "kvgrid.securityEnv" (dict "root" $root "component" "worker") | trim }}{{ . | nindent 6 }}{{ end }}
      {{- end }}
      {{- include "kvgrid.commonEnv" (dict "root" $root "values" $v "component" "worker") | nindent 6 }}
    {{- if $leader }}
    {{- include "kvgrid.probes" (dict "root" $root "component" "worker" "values" $v) | nindent 4 }}
    {{- end }}
    resources:
      requests:
        {{- toYaml $v.resources.requests | nindent 8 }}
        {{- if gt $gpus 0 }}
        {{ $v.gpu.resourceName }}: {{ $gpus }}
        {{- end }}
      limits:
        {{- with $v.resources.limits }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- if gt $gpus 0 }}
        {{ $v.gpu.resourceName }}: {{ $gpus }}
        {{- end }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: shm
        mountPath: /dev/shm
      {{- if $root.Values.models.volume }}
      - name: models
        mountPath: /models
        readOnly: true
      {{- end }}
      {{- if $leader }}
      {{- with include "kvgrid.securityVolumeMounts" (dict "root" $root "component" "worker") | trim }}{{ . | nindent 6 }}{{ end }}
      {{- end }}
volumes:
  - name: tmp
    emptyDir: {}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.shmSize }}
  {{- if $root.Values.models.volume }}
  - name: models
    {{- toYaml $root.Values.models.volume | nindent 4 }}
  {{- end }}
  {{- if $leader }}
  {{- with include "kvgrid.securityVolumes" (dict "root" $root "component" "worker") | trim }}{{ . | nindent 2 }}{{ end }}
  {{- end }}
{{- include "kvgrid.scheduling" $v }}
{{- end }}

{{/* Ranks of one pod: tensor x pipeline parallel over workerGroup.nodes (which must divide them). */}}
{{- define "kvgrid.ranksPerNode" -}}
{{- $tp := atoi (toString (index .Values.config "KVGRID_TENSOR_PARALLEL_SIZE" | default "1")) }}
{{- $pp := atoi (toString (index .Values.config "KVGRID_PIPELINE_PARALLEL_SIZE" | default "1")) }}
{{- $nodes := int .Values.workerGroup.nodes }}
{{- if mod (mul $tp $pp) $nodes }}
{{- fail (printf "workerGroup.nodes %d must divide the group's %d ranks (tensor x pipeline parallel size)" $nodes (mul $tp $pp)) }}
{{- end }}
{{- div (mul $tp $pp) $nodes }}
{{- end }}

{{/* "true" when the worker groups are LeaderWorkerSets: several nodes, and workerGroup.leaderWorkerSet true, or
     auto on a cluster that serves leaderworkerset.x-k8s.io/v1; else "". */}}
{{- define "kvgrid.leaderWorkerSet" -}}
{{- $g := .Values.workerGroup }}
{{- if gt (int $g.nodes) 1 }}
{{- $choice := toString $g.leaderWorkerSet }}
{{- if or (eq $choice "true") (and (eq $choice "auto") (.Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1")) -}}
true
{{- end }}
{{- end }}
{{- end }}
