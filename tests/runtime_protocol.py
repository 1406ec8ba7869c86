"""Run by the CPU runtime's Python with a vendor root first on sys.path: what vLLM's OpenAI protocol makes of a chat
request that limits its answer with `max_completion_tokens` alone (as current OpenAI clients send it), sampling
and beam search. Prints one JSON object."""

import json
import sys


def main():
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(
        {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5})
    json.dump({"sampling": request.to_sampling_params(default_max_tokens=1000).max_tokens,
               "beam": request.to_beam_search_params(default_max_tokens=1000).max_tokens}, sys.__stdout__)


if __name__ == "__main__":
    sys.stdout = sys.stderr
    main()
