// Greedy reference decoding with llama.cpp's C API, for tests/data/gemma3_270m_llamacpp.json.
//
// Usage: llamacpp_greedy MODEL.gguf PROMPT_FILE N_PREDICT N_THREADS
// The prompt file's bytes are tokenized as llama.cpp's tools do for a raw completion (BOS added
// when the GGUF says tokenizer.ggml.add_bos_token; special-token text parsed), the whole prompt is
// decoded in one llama_decode call, then N_PREDICT tokens are taken greedily (argmax of the
// float32 logits, lowest id on a tie), end-of-generation tokens included (no early stop).
// Prints one JSON object: prompt_ids, output_ids and, per output token, the top-1 and top-2 logits
// (their difference is how close llama.cpp itself was to choosing another token).
// Build: g++ -O2 -std=c++17 scripts/llamacpp_greedy.cpp -I<llama.cpp>/include -I<llama.cpp>/ggml/include
//        -L<llama.cpp>/build/bin -lllama -lggml -lggml-base -Wl,-rpath,<llama.cpp>/build/bin
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static void quiet_log(enum ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: %s MODEL.gguf PROMPT_FILE N_PREDICT N_THREADS\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream buf;
    buf << in.rdbuf();
    const std::string prompt = buf.str();
    const int n_predict = std::atoi(argv[3]);
    const int n_threads = std::atoi(argv[4]);

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) { std::fprintf(stderr, "cannot load %s\n", model_path); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    int n = -llama_tokenize(vocab, prompt.data(), (int) prompt.size(), nullptr, 0, true, true);
    std::vector<llama_token> ids(n);
    if (llama_tokenize(vocab, prompt.data(), (int) prompt.size(), ids.data(), n, true, true) != n) return 1;

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n + n_predict + 8;
    cp.n_batch = n + n_predict + 8;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { std::fprintf(stderr, "cannot create a context\n"); return 1; }

    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> out;
    std::vector<float> top1, top2;
    llama_batch batch = llama_batch_get_one(ids.data(), (int) ids.size());
    llama_token next = 0;
    for (int step = 0; step < n_predict; ++step) {
        if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "llama_decode failed\n"); return 1; }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        float b1 = logits[0], b2 = -1e30f;
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > b1) { b2 = b1; b1 = logits[v]; best = v; }
            else if (logits[v] > b2) { b2 = logits[v]; }
        }
        next = best;
        out.push_back(next);
        top1.push_back(b1);
        top2.push_back(b2);
        batch = llama_batch_get_one(&next, 1);
    }
    std::printf("{\"prompt_ids\": [");
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? ", " : "", ids[i]);
    std::printf("], \"output_ids\": [");
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? ", " : "", out[i]);
    std::printf("], \"top1_logits\": [");
    for (size_t i = 0; i < top1.size(); ++i) std::printf("%s%.5f", i ? ", " : "", top1[i]);
    std::printf("], \"top2_logits\": [");
    for (size_t i = 0; i < top2.size(); ++i) std::printf("%s%.5f", i ? ", " : "", top2[i]);
    std::printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
