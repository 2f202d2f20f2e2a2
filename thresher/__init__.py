"""thresher: a model-compression pipeline service for Mixture-of-Experts language models.

REAP expert pruning and GPTQ / AWQ / NF4 / RTN quantization, chained by Prefect flows, tracked in
MLflow, published as standard Hugging Face checkpoints and validated by a bundled serving engine.
"""

import os

__version__ = "0.1.0"

# Offline by default: no telemetry, and nothing waits on a hub that cannot be reached. A user who
# wants the hub sets these variables to 0 before starting thresher.
for _key, _value in {
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
    # Prefect's temporary local server needs more than its default 20 s on a busy 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}.items():
    os.environ.setdefault(_key, _value)
