"""Drop-ins that let a framework's own MoE calls run on moejax: one module per framework,
each with that framework's signature and semantics; importing one imports nothing of its
framework."""
