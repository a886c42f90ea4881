"""The HTTP frontends: LMI, SageMaker, OpenAI, TGI, Anthropic, OIP REST and management routes."""
