{{- define "imp.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "imp.labels" -}}
app.kubernetes.io/name: imp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "imp.selector" -}}
app.kubernetes.io/name: imp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Image reference of one component: (list $ .Values.<component>.image "imp-<component>"). The component's
repository defaults to <image.repository>/<name>; a digest pins it (repository@sha256:...), otherwise the
tag (component tag, then image.tag, then the chart's appVersion) is used.
*/}}
{{- define "imp.image" -}}
{{- $root := index . 0 -}}{{- $img := index . 1 | default dict -}}{{- $name := index . 2 -}}
{{- $repo := $img.repository | default (printf "%s/%s" $root.Values.image.repository $name) -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $repo $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo ($img.tag | default $root.Values.image.tag | default $root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}
