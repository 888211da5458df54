{{/*
Named templates of the streamwarden chart.

Every template here takes one context:

    (dict "root" $ "values" <the streamwarden values>)

In this chart that is (dict "root" $ "values" .Values). A chart that lists
streamwarden as a dependency passes its own root and the subchart's values:
(dict "root" $ "values" .Values.streamwarden). Names, labels and the image
therefore never depend on which chart is rendering.

Public (stable, documented in README.md "Inject into your own chart"):
  streamwarden.configmap                      the sidecar's ConfigMap (a whole object)
  streamwarden.container                      the sidecar container (one list item)
  streamwarden.initContainers                 the sidecar, if native (else nothing)
  streamwarden.containers                     the sidecar, if not native (else nothing)
  streamwarden.volumes                        the sidecar's volumes (list items)
  streamwarden.podAnnotations                 config checksum (+ scrape annotations)
  streamwarden.terminationGracePeriodSeconds  seconds that cover preStop + drain
  streamwarden.nativeSidecar                  "true" or "false"
  streamwarden.proxyPort                      the sidecar's proxy port (from `listen`)
*/}}

{{- define "streamwarden.name" -}}
{{- default "streamwarden" .values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "streamwarden.fullname" -}}
{{- if .values.fullnameOverride -}}
{{- .values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "streamwarden.name" . -}}
{{- if contains $name .root.Release.Name -}}
{{- .root.Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .root.Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of the ConfigMap; also what streamwarden.volumes mounts. */}}
{{- define "streamwarden.configName" -}}
{{- printf "%s-config" (include "streamwarden.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{- define "streamwarden.metricsServiceName" -}}
{{- printf "%s-metrics" (include "streamwarden.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{- define "streamwarden.serviceAccountName" -}}
{{- if .values.serviceAccount.create -}}
{{- default (include "streamwarden.fullname" .) .values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "streamwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ include "streamwarden.name" . }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "streamwarden.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "streamwarden.selectorLabels" . }}
app.kubernetes.io/part-of: streamwarden
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/*
The pods the monitoring objects select: this chart's pods in wrap mode, the
host chart's (inject.podSelector) in inject mode.
*/}}
{{- define "streamwarden.podSelector" -}}
{{- if eq .values.mode "inject" -}}
{{- toYaml .values.inject.podSelector -}}
{{- else -}}
{{- include "streamwarden.selectorLabels" . -}}
{{- end -}}
{{- end -}}

{{/*
The streamwarden chart's appVersion, also when a host chart renders: then
.root.Chart is the host's, and the subchart's metadata is in .root.Subcharts.
*/}}
{{- define "streamwarden.appVersion" -}}
{{- if eq .root.Chart.Name "streamwarden" -}}
{{- .root.Chart.AppVersion -}}
{{- else if and .root.Subcharts (hasKey .root.Subcharts "streamwarden") -}}
{{- (index .root.Subcharts "streamwarden").Chart.AppVersion -}}
{{- else -}}
{{- fail "streamwarden: set streamwarden.image.tag (the chart's appVersion is not reachable under a dependency alias)" -}}
{{- end -}}
{{- end -}}

{{- define "streamwarden.image" -}}
{{- $image := .values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default (include "streamwarden.appVersion" .) $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Whole seconds, rounded up, of a duration: 25s, 250ms, 2m, 1h or a number of seconds. */}}
{{- define "streamwarden.seconds" -}}
{{- $pattern := "^([0-9]+(?:\\.[0-9]+)?)\\s*(ms|s|m|h)?$" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}
{{- ceil (float64 .) | int -}}
{{- else if regexMatch $pattern (toString . | trim) -}}
{{- $text := toString . | trim -}}
{{- $number := regexReplaceAll $pattern $text "${1}" | float64 -}}
{{- $unit := regexReplaceAll $pattern $text "${2}" -}}
{{- $factor := get (dict "ms" 0.001 "s" 1.0 "" 1.0 "m" 60.0 "h" 3600.0) $unit -}}
{{- ceil (mulf $number $factor) | int -}}
{{- else -}}
{{- fail (printf "streamwarden: %q is not a duration (e.g. 25s, 250ms, 2m)" (toString .)) -}}
{{- end -}}
{{- end -}}

{{/* The port of a HOST:PORT address. */}}
{{- define "streamwarden.port" -}}
{{- regexReplaceAll "^.*:([0-9]+)$" . "${1}" -}}
{{- end -}}

{{/* The host of a HOST:PORT address, without IPv6 brackets. */}}
{{- define "streamwarden.host" -}}
{{- regexReplaceAll "^\\[?(.*?)\\]?:[0-9]+$" . "${1}" -}}
{{- end -}}

{{- define "streamwarden.proxyPort" -}}
{{- include "streamwarden.port" .values.listen -}}
{{- end -}}

{{- define "streamwarden.adminPort" -}}
{{- include "streamwarden.port" .values.admin_listen -}}
{{- end -}}

{{/* The port the Service (and the NetworkPolicy) lets clients in on. */}}
{{- define "streamwarden.servicePort" -}}
{{- if eq .values.placement "egress" -}}
{{- int .values.app.port -}}
{{- else -}}
{{- include "streamwarden.proxyPort" . -}}
{{- end -}}
{{- end -}}

{{- define "streamwarden.upstream" -}}
{{- default (printf "http://127.0.0.1:%d" (int .values.app.port)) .values.upstream -}}
{{- end -}}

{{- define "streamwarden.nativeSidecar" -}}
{{- $native := .values.sidecar.native -}}
{{- if eq (toString $native) "auto" -}}
{{- semverCompare ">=1.29.0-0" .root.Capabilities.KubeVersion.Version -}}
{{- else -}}
{{- $native -}}
{{- end -}}
{{- end -}}

{{/*
Seconds the pod may take to stop. The sidecar needs its preStop pause, then
drain_timeout, then a moment to write the `shutting_down` events and exit.
A native sidecar is stopped only after the app has exited, so the app's
preStop pause comes first.
*/}}
{{- define "streamwarden.terminationGracePeriodSeconds" -}}
{{- $v := .values -}}
{{- $floor := add (include "streamwarden.seconds" $v.drain_timeout | int) (int $v.sidecar.preStop.sleepSeconds) -}}
{{- if not (kindIs "invalid" $v.terminationGracePeriodSeconds) -}}
{{- $grace := int $v.terminationGracePeriodSeconds -}}
{{- if le $grace $floor -}}
{{- fail (printf "streamwarden: terminationGracePeriodSeconds (%d) must exceed drain_timeout plus sidecar.preStop.sleepSeconds (%d), or streams are killed mid-drain" $grace $floor) -}}
{{- end -}}
{{- $grace -}}
{{- else -}}
{{- $app := 0 -}}
{{- if and (eq .values.mode "wrap") (eq (include "streamwarden.nativeSidecar" .) "true") -}}
{{- $app = int $v.app.preStop.sleepSeconds -}}
{{- end -}}
{{- add $floor $app 5 -}}
{{- end -}}
{{- end -}}

{{/* A preStop pause: the sleep action from Kubernetes 1.30, `sleep` in the image before. */}}
{{- define "streamwarden.preStop" -}}
{{- if semverCompare ">=1.30.0-0" .root.Capabilities.KubeVersion.Version -}}
sleep:
  seconds: {{ .seconds }}
{{- else -}}
exec:
  command: ["sleep", "{{ .seconds }}"]
{{- end -}}
{{- end -}}

{{/* Checks across values that a JSON schema cannot express; each fails with one clear line. */}}
{{- define "streamwarden.validate" -}}
{{- $v := .values -}}
{{- /* Outside the pod: the kubelet probes the admin port, the Service the proxy port (front). */ -}}
{{- $reachable := list "admin_listen" -}}
{{- if eq $v.placement "front" -}}
{{- $reachable = append $reachable "listen" -}}
{{- end -}}
{{- range $key := $reachable -}}
{{- $host := include "streamwarden.host" (get $v $key) -}}
{{- if or (hasPrefix "127." $host) (eq $host "localhost") (eq $host "::1") -}}
{{- fail (printf "streamwarden: %s %q is a loopback address, unreachable from outside the pod; use 0.0.0.0" $key (get $v $key)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $v.placement "egress") (not $v.upstream) -}}
{{- fail "streamwarden: placement egress needs upstream, the LLM provider's URL (e.g. https://api.openai.com)" -}}
{{- end -}}
{{- if eq (include "streamwarden.proxyPort" .) (include "streamwarden.adminPort" .) -}}
{{- fail (printf "streamwarden: listen and admin_listen use the same port %s" (include "streamwarden.proxyPort" .)) -}}
{{- end -}}
{{- if eq $v.mode "wrap" -}}
{{- $appPort := toString (int $v.app.port) -}}
{{- if or (eq $appPort (include "streamwarden.proxyPort" .)) (eq $appPort (include "streamwarden.adminPort" .)) -}}
{{- fail (printf "streamwarden: app.port %s is also a port of the sidecar (listen %s, admin_listen %s)" $appPort $v.listen $v.admin_listen) -}}
{{- end -}}
{{- end -}}
{{- $_ := include "streamwarden.terminationGracePeriodSeconds" . -}}
{{- if and $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled -}}
{{- fail "streamwarden: enable metrics.serviceMonitor or metrics.podMonitor, not both (every pod would be scraped twice)" -}}
{{- end -}}
{{- if and (eq $v.mode "inject") (or $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled) (not $v.inject.podSelector) -}}
{{- fail "streamwarden: in inject mode, set inject.podSelector to your pods' labels so the monitors can find them" -}}
{{- end -}}
{{- end -}}

{{/* The sidecar's config.yaml: the explicit keys win over the free-form `config` map. */}}
{{- define "streamwarden.configYaml" -}}
{{- $v := .values -}}
{{- $config := deepCopy (default dict $v.config) -}}
{{- $_ := set $config "listen" $v.listen -}}
{{- $_ = set $config "admin_listen" $v.admin_listen -}}
{{- $_ = set $config "upstream" (include "streamwarden.upstream" .) -}}
{{- $_ = set $config "drain_timeout" $v.drain_timeout -}}
{{- $_ = set $config "keepalive_interval" $v.keepalive_interval -}}
{{- with $v.resume }}{{- with .redis }}{{- if and .url (not .existingSecret) }}
{{- $_ = set $config "resume_store" .url -}}
{{- end }}{{- end }}{{- end }}
# streamwarden config, rendered by the streamwarden chart from its values.
{{ toYaml $config }}
{{- end -}}

{{- define "streamwarden.configmap" -}}
{{- include "streamwarden.validate" . -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "streamwarden.configName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "streamwarden.labels" . | nindent 4 }}
data:
  config.yaml: |
    {{- include "streamwarden.configYaml" . | nindent 4 }}
{{- end -}}

{{- define "streamwarden.podAnnotations" -}}
checksum/streamwarden-config: {{ include "streamwarden.configYaml" . | sha256sum }}
{{- if .values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ include "streamwarden.adminPort" . | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{- define "streamwarden.volumes" -}}
- name: streamwarden-config
  configMap:
    name: {{ include "streamwarden.configName" . }}
- name: streamwarden-tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}

{{- define "streamwarden.container" -}}
{{- include "streamwarden.validate" . -}}
{{- $v := .values -}}
{{- $admin := include "streamwarden.adminPort" . | int -}}
- name: streamwarden
  image: {{ include "streamwarden.image" . | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if eq (include "streamwarden.nativeSidecar" .) "true" }}
  # A native sidecar: started before the app containers, stopped after them.
  restartPolicy: Always
  {{- end }}
  command: ["streamwarden"]
  args:
    - run
    - --config
    - /etc/streamwarden/config.yaml
    {{- with $v.sidecar.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $redisSecret := "" }}
  {{- $ownerSecret := "" }}
  {{- with $v.resume }}{{- with .redis }}{{- $redisSecret = .existingSecret }}{{- end }}{{- end }}
  {{- with $v.resume }}{{- with .secret }}{{- $ownerSecret = .existingSecret }}{{- end }}{{- end }}
  {{- if or $v.sidecar.env $redisSecret $ownerSecret }}
  env:
    {{- with $v.sidecar.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- if $redisSecret }}
    # The shared resume store's URL (it may hold a password): from a Secret.
    - name: STREAMWARDEN_RESUME_STORE
      valueFrom:
        secretKeyRef:
          name: {{ $redisSecret | quote }}
          key: {{ $v.resume.redis.secretKey | default "url" | quote }}
    {{- end }}
    {{- if $ownerSecret }}
    # The key of resumable streams' owner digests: from a Secret, never the ConfigMap.
    - name: STREAMWARDEN_RESUME_SECRET
      valueFrom:
        secretKeyRef:
          name: {{ $ownerSecret | quote }}
          key: {{ $v.resume.secret.secretKey | default "secret" | quote }}
    {{- end }}
  {{- end }}
  ports:
    - name: sw-proxy
      containerPort: {{ include "streamwarden.proxyPort" . }}
      protocol: TCP
    - name: sw-admin
      containerPort: {{ $admin }}
      protocol: TCP
  startupProbe:
    httpGet:
      path: /healthz
      port: {{ $admin }}
    {{- toYaml $v.sidecar.startupProbe | nindent 4 }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: {{ $admin }}
    {{- toYaml $v.sidecar.readinessProbe | nindent 4 }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: {{ $admin }}
    {{- toYaml $v.sidecar.livenessProbe | nindent 4 }}
  {{- if gt (int $v.sidecar.preStop.sleepSeconds) 0 }}
  lifecycle:
    preStop:
      {{- include "streamwarden.preStop" (dict "root" .root "seconds" (int $v.sidecar.preStop.sleepSeconds)) | nindent 6 }}
  {{- end }}
  resources:
    {{- toYaml $v.sidecar.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.sidecar.securityContext | nindent 4 }}
  volumeMounts:
    - name: streamwarden-config
      mountPath: /etc/streamwarden
      readOnly: true
    - name: streamwarden-tmp
      mountPath: /tmp
{{- end -}}

{{- define "streamwarden.initContainers" -}}
{{- if eq (include "streamwarden.nativeSidecar" .) "true" -}}
{{- include "streamwarden.container" . -}}
{{- end -}}
{{- end -}}

{{- define "streamwarden.containers" -}}
{{- if ne (include "streamwarden.nativeSidecar" .) "true" -}}
{{- include "streamwarden.container" . -}}
{{- end -}}
{{- end -}}

{{/* The webhook's Service (and Deployment, and MutatingWebhookConfiguration). */}}
{{- define "streamwarden.webhookName" -}}
{{- printf "%s-webhook" (include "streamwarden.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{/*
The webhook's pods: a name of their own, so that the wrap mode's Service,
NetworkPolicy, PodDisruptionBudget and monitors never select them.
*/}}
{{- define "streamwarden.webhookSelectorLabels" -}}
app.kubernetes.io/name: {{ include "streamwarden.name" . | trunc 55 | trimSuffix "-" }}-webhook
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: webhook
{{- end -}}

{{/* "true" when cert-manager issues the webhook's certificate. */}}
{{- define "streamwarden.webhookCertManager" -}}
{{- $choice := .values.webhook.certificate.certManager -}}
{{- if eq (toString $choice) "auto" -}}
{{- .root.Capabilities.APIVersions.Has "cert-manager.io/v1" -}}
{{- else -}}
{{- $choice -}}
{{- end -}}
{{- end -}}
