"""The patient proxy: answers agents in front of vLLM's OpenAI API.

While the arbiter's mode is not ``llm`` it holds requests (bounded by a count and a time),
retries refused connections while vLLM starts, streams responses through unbuffered and
answers a clear 503 with ``Retry-After`` when a bound is hit, never a 502. It decides on a
request's head alone and leaves a held request's body unread until release; slow clients
are cut off by :mod:`cardshare.serverguard`. ``/proxy/state`` reports in-flight and held
requests (and their buffered body bytes) to the arbiter; ``/metrics`` speaks Prometheus text.
With a key file, a proxied request needs ``Authorization: Bearer KEY`` (401 otherwise), each
key has its own bound on held and in-flight requests (429), and the upstream gets the proxy's
own key instead of the agent's; listening beyond loopback requires a key file. With
``boxes`` it routes to several boxes (a fleet), each request to a box whose arbiter says
``llm`` and that serves its ``model``; ``/proxy/fleet`` draws the fleet for a person.

Modules: ``config`` (settings, JSON file and CLI flags), ``rules`` (pure decisions: admission,
retry backoff, header filtering, error bodies), ``mode`` (the arbiter's mode and its source),
``fleet`` (the boxes, which one takes a request), ``fleetpage`` (the fleet view's HTML),
``holdqueue`` (the FIFO of held requests), ``keys`` (the agents' hashed API keys and their
file, reloaded when it changes), ``keytool`` (``cardshare proxy key add``), ``metrics``
(counters and their ``prometheus_client`` metric families), ``upstream`` (the HTTP/1.1 client
to vLLM, pooled keep-alive connections), ``server`` (the aiohttp edge). Run with
``python -m cardshare.proxy --config FILE``.
"""
