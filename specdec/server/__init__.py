"""An OpenAI-compatible HTTP server over one SpeculativeDecoder (`specdec serve`).

Continuous batching (`batch`): one thread runs every generation in one batch, one engine step at a
time (all rows in one target forward). Requests wait in a bounded first-in first-out queue (429
with Retry-After when it is full) and join the batch between steps, up to `max_batch` at once; a
finished generation leaves at once, and one whose client went away (streamed or not) leaves at the
next step, its slots freed. Joining prompts are prefilled a chunk per step, and stop strings cost
time linear in the new text, so no request holds up the others for more than its share of a step.
The draft depth of a step follows the batch size (`specdec.policy`).
The wire format (`openai`) refuses what it does not honour; every error a client can cause is an
OpenAI-style JSON error with a 4xx status. A `service` holds the batch, its metrics and its
health; the `app`'s routes are a view on it. `http` runs it under uvicorn with deadlines and a
bounded shutdown; `replicas` runs it as Ray Serve replicas behind an ingress that keeps a
conversation on the replica whose cache holds it.
"""

from specdec.server.app import create_app, routes
from specdec.server.http import serve
from specdec.server.service import Service

__all__ = ["Service", "create_app", "routes", "serve"]
