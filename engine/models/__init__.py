"""How each architecture computes, apart from where its weights live (engine/targets/):

- llama_family.py  the fast forward of the Llama family (Llama, Mistral, Qwen2/3, SmolLM)
- hf_forward.py    any causal LM transformers builds, run by its own modules over our cache
- norms.py         which faster RMSNorm forms give the reference's bits on this machine
"""
