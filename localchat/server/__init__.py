"""localchat serve: the OpenAI-compatible HTTP API over the engine (serve_cli.py starts it)."""
