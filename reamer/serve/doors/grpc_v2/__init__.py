"""The Open Inference Protocol's gRPC form: KServe's grpc_predict_v2.proto, plus Triton's ModelConfig RPC."""
