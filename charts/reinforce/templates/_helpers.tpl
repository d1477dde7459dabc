{{/* The release's full name, at most 63 characters (a DNS label). */}}
{{- define "reinforce.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of the operator's objects; runs' children carry app.kubernetes.io/name=reinforce instead. */}}
{{- define "reinforce.selectorLabels" -}}
app.kubernetes.io/name: reinforce-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "reinforce.labels" -}}
{{ include "reinforce.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "reinforce.serviceAccountName" -}}
{{- default (include "reinforce.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/*
The labels the dashboards and alerts select by (scripts/generate/dashboards.py): run, component, instance,
taken from the pod's labels and name.
*/}}
{{- define "reinforce.relabelings" -}}
- {sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_instance], targetLabel: run}
- {sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component], targetLabel: component}
- {sourceLabels: [__meta_kubernetes_pod_name], targetLabel: instance}
{{- end }}
