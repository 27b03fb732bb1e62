"""The inference APIs as vLLM reads them: OpenAI completions, chat and Responses, Anthropic
Messages, their prompts, tokenizers and errors."""
