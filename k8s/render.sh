#!/usr/bin/env bash
# Renders one k8s/*.yaml-template with k8s/env.sh's settings, checked: the way to render the templates.
#
#   export IMAGE=123456789012.dkr.ecr.us-west-2.amazonaws.com/ptk:latest PVC_NAME=fsx-claim
#   bash k8s/render.sh k8s/pytorchjob.yaml-template > pytorchjob.yaml && kubectl apply -f pytorchjob.yaml
#
# Sources k8s/env.sh, which checks every value against what its place in the YAML allows (exit 2 naming
# the first bad one, nothing written), then replaces each ${VARIABLE} of the template by its value
# escaped for a YAML double-quoted string (\ and " escaped; env.sh refuses control characters). Every
# string in the templates stands between double quotes; the only unquoted ${...} are the integer
# settings, which env.sh allows as decimal digits only. So no value can end its string, add a key or a
# list item, or change a number into something else: the YAML holds each value as it was given.
# A ${...} that is not one of env.sh's variables is an error (a plain envsubst would empty it).
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;  # the header comment
  -*) echo "k8s/render.sh: unknown option $1 (usage: bash k8s/render.sh TEMPLATE > MANIFEST.yaml)" >&2; exit 2 ;;
esac
[ $# = 1 ] || { echo "usage: bash k8s/render.sh TEMPLATE > MANIFEST.yaml" >&2; exit 2; }
template=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -f "$template" ] || { echo "k8s/render.sh: $template: no such template" >&2; exit 2; }
# shellcheck source=env.sh
source "$here/env.sh" || exit 2
text=$(cat "$template" && echo x)  # the x keeps trailing newlines
text=${text%x}
# One pass from left to right: a value is never searched again (a value holding "${IMAGE}" stays so).
out=""
while [[ "$text" == *'${'* ]]; do
  out+=${text%%\$\{*}
  text=${text#*\$\{}
  name=${text%%\}*}
  if [[ "$text" != *'}'* || " $(echo $PTK_K8S_VARS) " != *" $name "* ]]; then
    echo "k8s/render.sh: $template: \${${name:0:40}} is not one of k8s/env.sh's variables" >&2
    exit 2
  fi
  text=${text#*\}}
  val=${!name}
  val=${val//\\/\\\\}
  val=${val//\"/\\\"}
  out+=$val
done
printf '%s' "$out$text"
