"""The front doors: HTTP/REST and gRPC servers that translate the protocol into calls on the job runtime."""
