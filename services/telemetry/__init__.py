"""telemetry: fleet metrics (`/metrics`), quantile summaries, and the replay stream.

`python -m services.telemetry` runs `TelemetryService` (service.py) until SIGTERM.
"""

VERSION = "0.1.0"
