"""reamer's NRI plugin (Kubernetes nodes): ttRPC, NRI's connection multiplexing, the plugin stub and policy.

The generated protobuf modules in proto/ come from NRI's pkg/api/api.proto and ttRPC's request.proto
(scripts/gen_nri_protos.sh regenerates them).
"""
