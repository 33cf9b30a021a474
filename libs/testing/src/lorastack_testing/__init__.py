"""Test support shared by every package's tests and the benchmarks (in no image).

fake_vllm   the one fake vLLM: FakeState, the ASGI app FakeVLLM, FakeServer (a thread)
net         free_port, serve_in_thread (any ASGI app with uvicorn on loopback)
"""
