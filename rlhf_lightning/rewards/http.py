"""One JSON request to a reward endpoint (a reward server, an OpenAI-compatible judge): the package's one HTTP client,
:mod:`rlhf_lightning.utils.http` (a timeout per try, retries with exponential back-off on what may pass, said aloud
while they last, and one line naming the endpoint when it does not answer), under the name the reward sources
import it by.
"""

from __future__ import annotations

from rlhf_lightning.utils.http import EndpointError, get_json, post_json, request_json

__all__ = ["EndpointError", "get_json", "post_json", "request_json"]
