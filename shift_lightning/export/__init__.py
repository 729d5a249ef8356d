"""What leaves the project for other runtimes: the merged model and PEFT adapter folder a recovery writes
(:mod:`.merged`), and the GGUF file of a stock folder for llama.cpp (:mod:`.gguf`, with llama.cpp's own converter:
:mod:`.gguf_converter`)."""
