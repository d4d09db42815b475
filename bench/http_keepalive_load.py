#!/usr/bin/env python3
"""Keep-alive HTTP load on a router's OpenAI endpoint, counting every outcome.

C clients, each on one persistent HTTP/1.1 connection (http.client, as
Python SDKs pool them), send completions with a random pause between
requests (think time, or a slow client thread), for D seconds. An error a
client sees on a connection the server had accepted (BrokenPipeError,
ConnectionResetError, RemoteDisconnected) is counted by type: it is the
server closing a connection under a request in flight — the "BrokenPipe
under load" of issue 45. A client that reconnects does so only after such
an error (counted), never silently.

  bench/http_keepalive_load.py --address 127.0.0.1:8000 [--clients 60]
      [--seconds 20] [--prompt-words 150] [--max-tokens 16]
      [--pause-max 1.5]
"""
import argparse
import collections
import http.client
import json
import random
import threading
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--clients", type=int, default=60)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pause-max", type=float, default=1.5,
                   help="pause between requests, uniform in [0, this] s")
    p.add_argument("--model", default="")
    args = p.parse_args()
    host, port = args.address.rsplit(":", 1)
    words = ("once upon a time there was a little girl named lily who "
             "liked to play in the park with her dog").split()
    outcomes = collections.Counter()
    lock = threading.Lock()
    deadline = time.time() + args.seconds

    def client(index):
        rng = random.Random(index)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        while time.time() < deadline:
            prompt = " ".join(rng.choice(words)
                              for _ in range(args.prompt_words))
            body = {"prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0}
            if args.model:
                body["model"] = args.model
            try:
                conn.request("POST", "/v1/completions", json.dumps(body),
                             {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                key = f"HTTP {response.status}"
            except Exception as e:  # noqa: BLE001 - every kind is counted
                key = type(e).__name__
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
            with lock:
                outcomes[key] += 1
            time.sleep(rng.uniform(0, args.pause_max))
        conn.close()

    threads = [threading.Thread(target=client, args=(i,))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(outcomes.values())
    print(json.dumps({"requests": total, "outcomes": dict(outcomes)}))


if __name__ == "__main__":
    main()
