{{/*
Names. Namespaced objects are named after the release; cluster-scoped ones
(ClusterRoles, their bindings, the admission policy) add the release
namespace, so two releases in different namespaces never overwrite each
other's.
*/}}
{{- define "genswap.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "genswap.fullname" -}}
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

{{- define "genswap.controller.fullname" -}}
{{- printf "%s-controller" (include "genswap.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "genswap.agent.fullname" -}}
{{- printf "%s-node-agent" (include "genswap.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "genswap.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "genswap.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "genswap.controller.serviceAccountName" -}}
{{- default (include "genswap.controller.fullname" .) .Values.controller.serviceAccount.name -}}
{{- end -}}

{{- define "genswap.agent.serviceAccountName" -}}
{{- default (include "genswap.agent.fullname" .) .Values.agent.serviceAccount.name -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "genswap.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "genswap.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: genswap
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "controller"). */}}
{{- define "genswap.selectorLabels" -}}
app.kubernetes.io/name: {{ include "genswap.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "genswap.componentLabels" -}}
{{ include "genswap.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
The image of a component: its own repository/tag/digest where set, else the
chart-wide image; the tag defaults to the chart's appVersion. A digest pins
the image (repository@sha256:...) and wins over the tag.
Call with (dict "ctx" $ "image" .Values.controller.image).
*/}}
{{- define "genswap.image" -}}
{{- $global := .ctx.Values.image -}}
{{- $repository := default $global.repository .image.repository -}}
{{- $tag := default (default .ctx.Chart.AppVersion $global.tag) .image.tag -}}
{{- $digest := default $global.digest .image.digest -}}
{{- if $digest -}}
{{- printf "%s@%s" $repository $digest -}}
{{- else -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "genswap.pullPolicy" -}}
{{- default .ctx.Values.image.pullPolicy .image.pullPolicy -}}
{{- end -}}

{{/* host:port from (dict "host" "port"), IPv6 hosts in brackets. */}}
{{- define "genswap.hostPort" -}}
{{- if contains ":" .host -}}
{{- printf "[%s]:%d" .host (int .port) -}}
{{- else -}}
{{- printf "%s:%d" .host (int .port) -}}
{{- end -}}
{{- end -}}

{{/* The agent's metrics address. */}}
{{- define "genswap.agent.metricsAddr" -}}
{{- include "genswap.hostPort" (dict "host" .Values.agent.metrics.host "port" .Values.agent.metrics.port) -}}
{{- end -}}

{{/*
Where the kubelet probes the controller: the pod's IP (empty) unless it
listens on loopback, which only a hostNetwork pod can, the kubelet then
reaching it on the node's loopback.
*/}}
{{- define "genswap.controller.probeHost" -}}
{{- $c := .Values.controller -}}
{{- if has $c.metrics.host (list "127.0.0.1" "::1") -}}
{{- if not $c.hostNetwork -}}
{{- fail (printf "controller.metrics.host %s needs controller.hostNetwork: true (the kubelet probes the pod's own address, not its loopback)" $c.metrics.host) -}}
{{- end -}}
{{- $c.metrics.host -}}
{{- end -}}
{{- end -}}

{{/*
KUBERNETES_SERVICE_HOST/PORT from apiServer, for in-cluster clients, when
set; they win over the kubelet's own (a container's env does).
*/}}
{{- define "genswap.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | quote }}
{{- end }}
{{- end -}}

{{/*
Where the kubelet probes the agent: the agent shares the node's network
(hostNetwork), so loopback from the kubelet is the agent's loopback.
*/}}
{{- define "genswap.agent.probeHost" -}}
{{- if eq .Values.agent.metrics.host "::1" "::" -}}
::1
{{- else -}}
127.0.0.1
{{- end -}}
{{- end -}}

{{/* The agent's rules on genswap objects (docs/AGENT.md). */}}
{{- define "genswap.agent.objectRules" -}}
- apiGroups: ["genswap.dev"]
  resources: ["swapattempts"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["genswap.dev"]
  resources: ["swapattempts/status"]
  verbs: ["patch"]
- apiGroups: ["genswap.dev"]
  resources: ["instancegenerations"]
  verbs: ["get"]
{{- end -}}

{{/* The controller's rules on genswap objects and Events (docs/CONTROLLER.md). */}}
{{- define "genswap.controller.objectRules" -}}
- apiGroups: ["genswap.dev"]
  resources: ["instancegenerations"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["genswap.dev"]
  resources: ["instancegenerations/status"]
  verbs: ["patch"]
{{- if .Values.controller.rbac.ownerReferencesPermissionEnforcement }}
- apiGroups: ["genswap.dev"]
  resources: ["instancegenerations/finalizers"]
  verbs: ["update"]
{{- end }}
- apiGroups: ["genswap.dev"]
  resources: ["swapattempts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
{{- define "genswap.controller.nodeRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
{{- end }}
