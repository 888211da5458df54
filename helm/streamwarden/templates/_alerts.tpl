{{/*
The alert rules, as a Prometheus rule-file `groups:` list. The PrometheusRule
renders it; configs/prometheus-rules.yaml is the same list rendered with the
default values, for Prometheus without the operator (a test keeps the two equal).

Every alert aggregates by (namespace, job): one alert per wrapped service, not
per pod. Ratios divide two rates over the same window, so they hold at any
traffic; a window with no streams gives NaN, which never fires.

Takes (dict "root" $ "values" <the streamwarden values>).
*/}}
{{- define "streamwarden.alertGroups" -}}
{{- $rules := .values.prometheusRule -}}
{{- $extraLabels := $rules.alertLabels -}}
- name: streamwarden
  rules:
    {{- with $rules.ttft }}
    {{- if .enabled }}
    - alert: StreamWardenTimeToFirstTokenHigh
      expr: |
        histogram_quantile(0.95,
          sum by (namespace, job, dialect, le) (rate(streamwarden_ttft_seconds_bucket[{{ .window }}]))
        ) > {{ .thresholdSeconds }}
      for: {{ .for }}
      labels:
        severity: {{ .severity }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        summary: p95 time to first token over {{ .thresholdSeconds }}s
        description: >-
          {{`{{ $labels.job }}`}} ({{`{{ $labels.namespace }}`}}): 95% of
          {{`{{ $labels.dialect }}`}} streams wait up to {{`{{ $value | humanizeDuration }}`}}
          for their first token. Users see a blank answer that long; check the
          model server's queue and prefill time.
    {{- end }}
    {{- end }}
    {{- with $rules.unterminatedStreams }}
    {{- if .enabled }}
    - alert: StreamWardenStreamsEndWithoutTerminalEvent
      expr: |
        (
          sum by (namespace, job) (rate(streamwarden_streams_total{end_state=~"{{ join "|" .endStates }}"}[{{ .window }}]))
        /
          sum by (namespace, job) (rate(streamwarden_streams_total[{{ .window }}]))
        ) > {{ .ratio }}
      for: {{ .for }}
      labels:
        severity: {{ .severity }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        summary: Streams end without their terminal event
        description: >-
          {{`{{ $labels.job }}`}} ({{`{{ $labels.namespace }}`}}):
          {{`{{ $value | humanizePercentage }}`}} of streams ended truncated, broken or
          silent upstream ({{ join ", " .endStates }}). streamwarden wrote an
          error event to each, so clients saw a failure instead of a cut answer;
          streamwarden_synthesized_errors_total{code} says which failure.
    {{- end }}
    {{- end }}
    {{- with $rules.zombieTokens }}
    {{- if .enabled }}
    - alert: StreamWardenZombieTokensHigh
      expr: |
        (
          sum by (namespace, job, dialect) (rate(streamwarden_zombie_tokens_total[{{ .window }}]))
        /
          sum by (namespace, job, dialect) (rate(streamwarden_tokens_delivered_total[{{ .window }}]))
        ) > {{ .ratio }}
      for: {{ .for }}
      labels:
        severity: {{ .severity }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        summary: Tokens generated after the client left
        description: >-
          {{`{{ $labels.job }}`}} ({{`{{ $labels.namespace }}`}}): tokens generated
          after the client had gone amount to {{`{{ $value | humanizePercentage }}`}}
          of the tokens delivered on {{`{{ $labels.dialect }}`}} streams. The
          upstream keeps generating (and holding GPU memory) for nobody: check
          that it aborts when its connection closes.
    {{- end }}
    {{- end }}
    {{- with $rules.clientCancels }}
    {{- if .enabled }}
    {{- $cancelled := printf "sum by (namespace, job) (rate(streamwarden_streams_total{end_state=\"client_cancelled\"}[%s]))" .window }}
    {{- $all := printf "sum by (namespace, job) (rate(streamwarden_streams_total[%s]))" .window }}
    - alert: StreamWardenClientCancelsRising
      expr: |
        (
          {{ $cancelled }}
        /
          {{ $all }}
        ) > {{ .ratio }}
        and
        (
          {{ $cancelled }}
        /
          {{ $all }}
        ) > {{ .factor }} * (
          sum by (namespace, job) (rate(streamwarden_streams_total{end_state="client_cancelled"}[{{ .baselineWindow }}]))
        /
          sum by (namespace, job) (rate(streamwarden_streams_total[{{ .baselineWindow }}]))
        )
      for: {{ .for }}
      labels:
        severity: {{ .severity }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        summary: More clients cancel their streams
        description: >-
          {{`{{ $labels.job }}`}} ({{`{{ $labels.namespace }}`}}):
          {{`{{ $value | humanizePercentage }}`}} of streams were cancelled by the
          client over the last {{ .window }}, more than {{ .factor }} times the
          {{ .baselineWindow }} average. Users give up on slow or bad answers:
          check TTFT and inter-token gaps.
    {{- end }}
    {{- end }}
    {{- with $rules.cancelPropagation }}
    {{- if .enabled }}
    - alert: StreamWardenCancelPropagationSlow
      expr: |
        histogram_quantile(0.99,
          sum by (namespace, job, le) (rate(streamwarden_cancel_propagation_seconds_bucket[{{ .window }}]))
        ) > {{ .thresholdSeconds }}
      for: {{ .for }}
      labels:
        severity: {{ .severity }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        summary: Cancelled streams keep their upstream open
        description: >-
          {{`{{ $labels.job }}`}} ({{`{{ $labels.namespace }}`}}): p99 time from
          client gone to upstream closed is {{`{{ $value | humanizeDuration }}`}}.
          The model keeps generating (and holding its KV cache) that long for
          every abandoned stream.
    {{- end }}
    {{- end }}
    {{- with $rules.engineUnseenTokens }}
    {{- if .enabled }}
    - alert: StreamWardenEngineUnseenTokens
      expr: |
        (
          sum by (namespace, job) (rate(streamwarden_engine_unseen_tokens_total[{{ .window }}]))
        /
          sum by (namespace, job) (rate(streamwarden_engine_generated_tokens_total[{{ .window }}]))
        ) > {{ .ratio }}
      for: {{ .for }}
      labels:
        severity: {{ .severity }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        summary: The engine generates tokens no stream accounts for
        description: >-
          {{`{{ $labels.job }}`}} ({{`{{ $labels.namespace }}`}}):
          {{`{{ $value | humanizePercentage }}`}} of the tokens the inference engine
          generated reached no stream through streamwarden: generations that go on
          after their client left (an engine that does not abort), or traffic that
          bypasses the sidecar.
    {{- end }}
    {{- end }}
    {{- with $rules.extraRules }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
