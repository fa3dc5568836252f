"""A llama.cpp server for the benchmarks: xllamacpp's embedded llama-server
with parallel slots, its threads and its alias chosen, and its Prometheus
``/metrics`` endpoint on.

Run with the xllamacpp venv's python (``/work/shared/local-llm/setup.sh``
installs it), not the project's::

    ~/.cache/fleetbus-llm/venv/bin/python bench/_llm_server.py MODEL.gguf \\
        --alias qwen --parallel 4 --threads 1

Prints ``LISTENING http://127.0.0.1:PORT`` once it serves (the port is a free
one), then serves until SIGTERM or SIGINT. It is llama-server's own HTTP
listener: ``/v1/chat/completions``, ``/health``, ``/slots`` and ``/metrics``
(``llamacpp:tokens_predicted_total``, ``llamacpp:prompt_tokens_total``…,
counted by the server itself: what the benchmarks read its throughput
from). CPU only, continuous batching, Jinja chat templates; each slot gets
``--ctx-per-slot`` tokens of context (``n_ctx`` is their sum: llama-server
divides it among the slots). ``--http-threads`` (64) serve the connections,
one each: requests beyond the slots wait in llama-server's own queue
(``llamacpp:requests_deferred``), not for an HTTP thread.
"""

import argparse
import signal
import threading
import time

import xllamacpp as xlc  # type: ignore[import-not-found]  # the local-llm venv's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the GGUF file")
    parser.add_argument("--alias", default="local", help="the model name it answers to")
    parser.add_argument("--parallel", type=int, default=4, help="slots (requests decoded at once)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (decode and batch)")
    parser.add_argument("--ctx-per-slot", type=int, default=4096, help="context tokens per slot")
    parser.add_argument(
        "--http-threads", type=int, default=64, help="HTTP threads (one per open connection)"
    )
    args = parser.parse_args()
    p = xlc.CommonParams()
    p.model.path = args.model
    p.model_alias = {args.alias}
    p.n_parallel = args.parallel
    p.n_ctx = args.ctx_per_slot * args.parallel
    p.cont_batching = True
    p.use_jinja = True
    p.warmup = False
    p.endpoint_metrics = True
    p.endpoint_slots = True
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.n_threads_http = args.http_threads
    p.hostnames = ["127.0.0.1"]
    p.port = 0
    started = time.time()
    server = xlc.Server(p)
    print(f"loaded in {time.time() - started:.1f}s", flush=True)
    print(f"LISTENING {server.listening_address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.is_set():
        stop.wait(1.0)


if __name__ == "__main__":
    main()
