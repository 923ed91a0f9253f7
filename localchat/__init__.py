"""localchat: chat with large language models on your own machine."""
import engine.openmp  # noqa: F401  (first: it sets how OpenMP threads wait before torch is imported)

__version__ = "0.1.0"
