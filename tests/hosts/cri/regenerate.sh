#!/bin/sh
# Regenerates api_pb2.py / api_pb2_grpc.py (the Kubernetes CRI, runtime.v1) from kubernetes/cri-api.
#
#   tests/hosts/cri/regenerate.sh /path/to/cri-api-checkout   # a git clone of github.com/kubernetes/cri-api
#
# Needs grpcio-tools (pip install -e '.[proto]'). The version is the CRI v1 of containerd 1.7's era; proto3
# ignores fields one side does not know, so a newer runtime still answers this client.
set -eu
CRI_API_TAG=v0.27.1
src=${1:?usage: $0 CRI_API_CHECKOUT}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tests/hosts/cri"
# gogoproto options only steer Go code generation: drop its import and options for Python.
git -C "$src" show "$CRI_API_TAG:pkg/apis/runtime/v1/api.proto" \
  | grep -v -e '^import "github.com/gogo/protobuf/gogoproto/gogo.proto";' -e '^option (gogoproto\.' \
  > "$work/tests/hosts/cri/api.proto"
# Placed at tests/hosts/cri/api.proto below the include root, so the generated modules import each other
# as tests.hosts.cri.api_pb2.
"$python" -m grpc_tools.protoc -I "$work" --python_out="$repo" --pyi_out="$repo" --grpc_python_out="$repo" \
  "$work/tests/hosts/cri/api.proto"
cp "$work/tests/hosts/cri/api.proto" "$here/api.proto"
echo "regenerated from kubernetes/cri-api $CRI_API_TAG into $here"
