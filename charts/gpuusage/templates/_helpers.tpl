{{/* The namespace of every namespaced object: namespace.name, else the release's. */}}
{{- define "gpuusage.namespace" -}}
{{- .Values.namespace.name | default .Release.Namespace -}}
{{- end -}}

{{/* On every object, as the kustomize install labels them (the CRDs carry it themselves). */}}
{{- define "gpuusage.partOf" -}}
app.kubernetes.io/part-of: gpuusage
{{- end -}}

{{/* The labels of one component's objects and pods: name and component. */}}
{{- define "gpuusage.componentLabels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* registry/repository:tag, or @digest; the tag defaults to the chart's appVersion.
     Called with (dict "image" <image values> "root" $). */}}
{{- define "gpuusage.image" -}}
{{- $registry := .image.registry | default .root.Values.image.registry -}}
{{- $name := .image.repository -}}
{{- if $registry }}{{ $name = printf "%s/%s" $registry $name }}{{ end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $name .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name (.image.tag | default .root.Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/* imagePullPolicy, when one is set. */}}
{{- define "gpuusage.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end -}}

{{/* imagePullSecrets, when any. */}}
{{- define "gpuusage.pullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* `--flag=value` for each (flag, value) pair whose value is set: nulls and empty lists
     leave the program's own default. Lists are joined with commas, as the flags take them.
     Called with a list of two-element lists. */}}
{{- define "gpuusage.flags" -}}
{{- range . }}
{{- $flag := index . 0 }}{{ $value := index . 1 }}
{{- if kindIs "slice" $value }}
{{- if $value }}
- {{ printf "--%s=%s" $flag (join "," $value) | quote }}
{{- end }}
{{- else if not (kindIs "invalid" $value) }}
- {{ printf "--%s=%v" $flag $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The labels the Prometheus Operator's objects carry: their own, the install's, and
     monitoring.labels for a Prometheus's selectors. Called with (dict "name" .. "root" $). */}}
{{- define "gpuusage.monitorLabels" -}}
app.kubernetes.io/name: {{ .name }}
{{ include "gpuusage.partOf" . }}
{{- with .root.Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* "true" or "false": crds.<key>, or "true" where the values have no crds (those of a
     release from before it existed, reused by `helm upgrade --reuse-values`).
     Called with (dict "key" "enabled" "root" $). */}}
{{- define "gpuusage.crds" -}}
{{- $crds := .root.Values.crds | default dict -}}
{{- if hasKey $crds .key }}{{ get $crds .key }}{{ else }}true{{ end -}}
{{- end }}

{{/* A pod template's annotations: the given ones, and on OpenShift the SCC that must admit the
     pod (openshift.io/required-scc), so that no other SCC the ServiceAccount may use is chosen
     in its place. Called with (dict "given" <annotations> "scc" <name> "root" $). */}}
{{- define "gpuusage.podAnnotations" -}}
{{- $annotations := deepCopy (.given | default dict) -}}
{{- if (.root.Values.openshift | default dict).enabled -}}
{{- $_ := set $annotations "openshift.io/required-scc" .scc -}}
{{- end -}}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The pod's user and group where the platform does not assign them: OpenShift's
     restricted-v2 gives each pod a user from its namespace's range and refuses a fixed one.
     Called with (dict "uid" <uid> "root" $). */}}
{{- define "gpuusage.fixedUser" -}}
{{- if not (.root.Values.openshift | default dict).enabled }}
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
{{- end }}
{{- end -}}
