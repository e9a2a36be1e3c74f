"""StepGap: a step checker (LLM stages plus NLI) labels each step and injects typed repairs."""
