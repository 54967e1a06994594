#!/bin/sh
# Regenerates reamer/nri/proto/*_pb2.py from the protocol's own sources:
#   - NRI's pkg/api/api.proto at NRI_TAG (the NRI that Debian 13's containerd 1.7.24 is built with: its
#     binary has no CDIDevice / LinuxPids types, which came in v0.7.0 — so v0.6.1; proto3 skips unknown
#     fields, so a runtime on a newer NRI still talks to this plugin);
#   - ttRPC's request.proto at TTRPC_TAG, with google.rpc.Status defined in the file itself (same field
#     numbers and types, so the same bytes on the wire) because googleapis-common-protos is not a dependency.
#
#   scripts/gen_nri_protos.sh NRI_CHECKOUT TTRPC_CHECKOUT    # git clones of containerd/nri and containerd/ttrpc
#
# Needs grpcio-tools (pip install -e '.[proto]').
set -eu
NRI_TAG=v0.6.1
TTRPC_TAG=v1.2.7
nri=${1:?usage: $0 NRI_CHECKOUT TTRPC_CHECKOUT}
ttrpc=${2:?usage: $0 NRI_CHECKOUT TTRPC_CHECKOUT}
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
out=$repo/reamer/nri/proto
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/reamer/nri/proto"
git -C "$nri" show "$NRI_TAG:pkg/api/api.proto" > "$work/reamer/nri/proto/api.proto"
git -C "$ttrpc" show "$TTRPC_TAG:request.proto" \
  | sed -E -e 's#^import "(google/rpc|proto)/status.proto";#import "google/protobuf/any.proto";#' \
        -e 's#google\.rpc\.Status status = 1;#Status status = 1;#' > "$work/reamer/nri/proto/ttrpc.proto"
cat >> "$work/reamer/nri/proto/ttrpc.proto" <<'PROTO'

// google.rpc.Status (googleapis google/rpc/status.proto), field for field.
message Status {
	int32 code = 1;
	string message = 2;
	repeated google.protobuf.Any details = 3;
}
PROTO
# Placed at reamer/nri/proto/ below the include root, so the modules import as reamer.nri.proto.api_pb2.
"$python" -m grpc_tools.protoc -I "$work" -I "$("$python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')" \
  --python_out="$repo" --pyi_out="$repo" "$work/reamer/nri/proto/api.proto" "$work/reamer/nri/proto/ttrpc.proto"
cp "$work/reamer/nri/proto/api.proto" "$work/reamer/nri/proto/ttrpc.proto" "$out/"
echo "regenerated from containerd/nri $NRI_TAG and containerd/ttrpc $TTRPC_TAG into $out"
