"""The engine: scheduler, model runner, sampling and detokenizing, and the process it steps in."""
