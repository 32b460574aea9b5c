"""OpenAI's Responses API over the chat path."""
