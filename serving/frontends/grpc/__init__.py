"""The gRPC frontend: Open Inference Protocol v2 and rollserve.v1 servicers on grpc.aio."""
