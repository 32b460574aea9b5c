"""OpenAI's API: completions, chat, models, logprobs, reasoning; responses/ and tools/."""
