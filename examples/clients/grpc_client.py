"""Stream tokens over rollserve's typed gRPC API (``rollserve.v1.Generation``), then print the timings.
The default ``smollm2`` is a rolling-batch model and streams; a dynamic-batching model cannot stream, and
the client then asks for the whole answer.

    python examples/clients/grpc_client.py --target 127.0.0.1:8001 --model smollm2 "Hello"

The same server speaks the Open Inference Protocol v2 (``tritonclient.grpc``: inputs ``text_input``,
``sampling_parameters`` (JSON), ``stream``, ``exclude_input_in_output``; output ``text_output``), health and
reflection, so the usual tools work:

    grpc_health_probe -addr 127.0.0.1:8001 -service smollm2
    grpcurl -plaintext 127.0.0.1:8001 list
    grpcurl -plaintext -d '{"model": "smollm2", "prompt": "Hello"}' 127.0.0.1:8001 rollserve.v1.Generation/Generate
"""

from __future__ import annotations

import argparse

import grpc

from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--target", default="127.0.0.1:8001")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds (aborts the request)")
    args = ap.parse_args()
    request = pb.GenerateRequest(model=args.model, prompt=args.prompt,
                                 parameters=pb.SamplingParameters(max_new_tokens=args.max_new_tokens))
    with grpc.insecure_channel(args.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        last: pb.GenerateStreamResponse | pb.GenerateResponse | None = None
        try:
            for last in stub.GenerateStream(request, timeout=args.timeout):
                print(last.text, end="", flush=True)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or "rolling" not in (exc.details() or ""):
                raise SystemExit(f"\n{exc.code().name}: {exc.details()}") from None
            last = stub.Generate(request, timeout=args.timeout)  # a dynamic-batching model answers at once
            print(last.text, end="")
    print()
    if last is not None:
        t = last.timings
        print(f"[{pb.FinishReason.Name(last.finish_reason)}] ttft {t.ttft_s * 1000:.1f} ms, "
              f"e2e {t.e2e_s * 1000:.1f} ms, {t.generated_tokens} tokens")


if __name__ == "__main__":
    main()
