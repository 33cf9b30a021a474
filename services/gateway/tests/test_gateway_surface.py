"""The rest of the OpenAI surface through the gateway, against the fake vLLM:
`GET /v1/models/{id}` (the official client's `models.retrieve`), vLLM's `/tokenize`
and `/detokenize` passed through with the chat routes' auth and model check,
`/v1/responses` (plain and streamed, length-checked before forwarding) and
`/v1/embeddings` (only to backends that embed)."""

from __future__ import annotations

import httpx
import openai
import pytest

KEY = "sk-surface-" + "0123456789abcdef" * 2  # API keys: at least 32 characters


def test_models_retrieve_with_the_openai_client(make_gateway, fake) -> None:
    url, state = fake
    state.models.append({"id": "org/adapter-1", "parent": "smollm2", "root": "/a"})
    with make_gateway([url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        m = client.models.retrieve("smollm2")
        assert m.id == "smollm2" and m.object == "model"
        assert m.model_extra and m.model_extra["max_model_len"] == 2048
        adapter = client.models.retrieve("org/adapter-1")  # an id with a slash
        assert adapter.model_extra and adapter.model_extra["parent"] == "smollm2"
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("nope")
        body = e.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found"
        assert "smollm2" in body["message"] and body["param"] == "model"


def test_models_retrieve_needs_a_key_when_auth_is_on(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url], auth_enabled=True, api_keys=[KEY]) as gw:
        assert httpx.get(f"{gw}/v1/models/smollm2").status_code == 401
        ok = httpx.get(f"{gw}/v1/models/smollm2", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["id"] == "smollm2"


def test_tokenize_and_detokenize_pass_through(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url], auth_enabled=True, api_keys=[KEY]) as gw:
        auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "tok-1"}
        r = httpx.post(
            f"{gw}/tokenize", json={"model": "smollm2", "prompt": "a bb ccc"}, headers=auth
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [1, 2, 3] and r.json()["count"] == 3
        assert r.headers["x-request-id"] == "tok-1"
        assert state.calls("/tokenize")[-1] == {"model": "smollm2", "prompt": "a bb ccc"}
        assert state.received_headers[-1]["x-request-id"] == "tok-1"
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "x yy"}]}
        assert httpx.post(f"{gw}/tokenize", json=chat, headers=auth).json()["count"] == 2
        r = httpx.post(
            f"{gw}/detokenize", json={"model": "smollm2", "tokens": [1, 2]}, headers=auth
        )
        assert r.status_code == 200 and r.json()["prompt"] == "w ww"
        # the chat routes' checks: key, model, body
        sent = len(state.received)
        r = httpx.post(f"{gw}/tokenize", json={"model": "smollm2", "prompt": "a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{gw}/tokenize", json={"model": "nope", "prompt": "a"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(f"{gw}/tokenize", json={"prompt": "a"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = httpx.post(f"{gw}/tokenize", content=b"[1,", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["request_id"] == "tok-1"
        assert len(state.received) == sent  # none of them reached the backend


def test_responses_plain_and_streamed_with_the_openai_client(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        raw = client.responses.with_raw_response.create(
            model="smollm2", input="Say hello.", instructions="Be brief.", max_output_tokens=4
        )
        r = raw.parse()
        assert r.output_text == "Hello, world!" and r.usage and r.usage.output_tokens == 4
        assert int(raw.headers["x-lorastack-prompt-tokens"]) > 0
        assert raw.headers["x-request-id"]
        sent = state.calls("/v1/responses")[-1]
        assert sent["input"] == "Say hello." and sent["max_output_tokens"] == 4
        assert "stream_options" not in sent  # the Responses API has no such field
        with client.responses.create(
            model="smollm2",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
                {  # an earlier output, as the Responses API returned it
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
                },
                {"role": "user", "content": "Again."},
            ],
            stream=True,
        ) as stream:
            events = list(stream)
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "Hello, world! Bye."
        last = events[-1]
        assert last.type == "response.completed" and last.response.usage is not None
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'route="responses"' in metrics


def test_responses_too_long_or_unsupported_is_400_before_forwarding(make_gateway, fake) -> None:
    url, state = fake
    with make_gateway([url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="smollm2", input="word " * 3000)
        err = e.value.body
        assert isinstance(err, dict) and err["code"] == "context_length_exceeded"
        assert "2048 tokens" in err["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="smollm2", input="Hi.", max_output_tokens=2047)
        err = e.value.body
        assert isinstance(err, dict) and err["param"] == "max_output_tokens"
        assert "Set max_output_tokens to at most" in err["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="smollm2", input="Hi.", previous_response_id="resp_1")
        err = e.value.body
        assert isinstance(err, dict) and err["param"] == "previous_response_id"
        assert "whole conversation in `input`" in err["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(
                model="smollm2",
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            )
        assert "counts only text parts" in str(e.value)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="nope", input="Hi.")
        assert state.calls("/v1/responses") == []  # none reached the backend


def test_embeddings_go_to_the_backend_that_embeds(make_gateway, fake, second_fake) -> None:
    (gen_url, gen), (emb_url, emb) = fake, second_fake
    emb.embeds = True
    with make_gateway([gen_url, emb_url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        for _ in range(4):
            r = client.embeddings.create(model="smollm2", input=["a bb", "ccc"])
            assert [d.embedding for d in r.data] == [[2.0, 4.0, 0.5, -1.0], [1.0, 3.0, 0.5, -1.0]]
        asked = [c for c in emb.calls("/v1/embeddings") if "input" in c]  # not the probe
        assert len(asked) == 4 and gen.calls("/v1/embeddings") == []


def test_embeddings_of_a_model_that_does_not_embed_is_400(make_gateway, fake) -> None:
    url, _ = fake
    with make_gateway([url]) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="sk-x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="smollm2", input="a")
        err = e.value.body
        assert isinstance(err, dict) and err["param"] == "model"
        assert "does not serve embeddings" in err["message"]
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="nope", input="a")
