"""Images in prompts: decoding them at the boundary (media.py), turning them into the model's
inputs with its own transformers processor (processor.py), and the plain data a request
carries from there to the runner (inputs.py)."""
