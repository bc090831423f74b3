"""ringleader: an LLM serving runtime whose continuous-batching scheduler runs on the GPU.

One namespace for the repository's top-level folders: ringleader.ipc (what both sides share: the
ring contract, the wire protocol, the client library, CURVE), ringleader.hostctl (the server, its
HTTP gateway, the command line), ringleader.device (backends, model, scheduler, tokenizers) and
ringleader.bench. In a checkout ringleader/ipc and the others are links to those folders, so the
source tree imports exactly what a wheel installs.
"""
