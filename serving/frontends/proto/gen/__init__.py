"""Generated from serving/frontends/proto/*.proto by generate.py (grpcio-tools 1.85.1). Do not edit."""
