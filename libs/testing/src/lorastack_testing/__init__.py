"""Test support shared by every package's tests and the benchmarks (in no image).

fake_vllm   the one fake vLLM: the ASGI app FakeVLLM, FakeServer (a thread); its FakeState
            in fake_state, its other routes in fake_routes, fake_responses, fake_metrics
dns_server  DnsServer: A records on loopback UDP, from a table the test changes
net         free_port, serve_in_thread (any ASGI app with uvicorn on loopback)
"""
