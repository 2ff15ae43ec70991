"""What the model reads: turns, OpenAI-style messages, chat templates, tools and plain-text marks."""
