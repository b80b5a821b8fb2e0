// kvp-tool.h - what the benchmark and check binaries on the llama.h + llama-kvp.h API share: integer arguments, the
// test tokens and a prompt's prefill as a policy wants it (guided chunks first where it guides).

#pragma once

#include "llama.h"
#include "llama-kvp.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef _WIN32
#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#endif

// a string as a JSON string: quotes and backslashes escaped, control characters (a tab or a newline in a path) as \u00XX
static inline std::string kvp_tool_json_str(const std::string & s) {
    std::string res = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            res += '\\';
            res += c;
        } else if ((unsigned char) c < 0x20) {
            char esc[8];
            snprintf(esc, sizeof(esc), "\\u%04x", (unsigned) (unsigned char) c);
            res += esc;
        } else {
            res += c;
        }
    }
    return res + "\"";
}

// the canonical spec of a policy, whatever its length
static inline std::string kvp_tool_policy_str(const llama_kvp_policy & pol) {
    std::string res(llama_kvp_policy_to_string(&pol, nullptr, 0) + 1, '\0');
    llama_kvp_policy_to_string(&pol, res.data(), res.size());
    res.resize(res.size() - 1);
    return res;
}

// the integer of digits at *p (no sign, no space) up to the first non-digit, which *end points at; false if there are
// no digits or the value is above INT32_MAX
static inline bool kvp_tool_digits(const char * p, const char ** end, int64_t & x) {
    x = 0;
    const char * q = p;
    for (; isdigit((unsigned char) *q); ++q) {
        x = x*10 + (*q - '0');
        if (x > INT32_MAX) {
            return false;
        }
    }
    *end = q;
    return q != p;
}

// "N": one integer >= min_value; throws with a message naming the flag
static inline int32_t kvp_tool_parse_int(const std::string & flag, const std::string & s, int32_t min_value) {
    const char * end = nullptr;
    int64_t x = 0;
    if (!kvp_tool_digits(s.c_str(), &end, x) || *end != '\0' || x < min_value) {
        throw std::invalid_argument(flag + ": expected an integer >= " + std::to_string(min_value) + ", got '" + s + "'");
    }
    return (int32_t) x;
}

// a comma-separated list of integers >= min_value; an item may be a range as llama-bench's: first-last (step 1),
// first-last+step or first-last*factor, last included when the steps reach it (-p 128-1024*2 = 128,256,512,1024);
// throws with a message naming the flag
static inline std::vector<int32_t> kvp_tool_parse_list(const std::string & flag, const std::string & s, int32_t min_value) {
    static const size_t n_max = 4096; // values one flag may expand to
    const std::string expect = flag + ": expected integers >= " + std::to_string(min_value) +
        " or ranges first-last[+step|*factor], got '" + s + "'";
    std::vector<int32_t> res;
    size_t i0 = 0;
    while (true) {
        const size_t i1 = std::min(s.find(',', i0), s.size());
        const std::string item = s.substr(i0, i1 - i0);
        const char * end = nullptr;
        int64_t first = 0;
        if (!kvp_tool_digits(item.c_str(), &end, first)) {
            throw std::invalid_argument(expect);
        }
        int64_t last = first;
        int64_t step = 1;
        char    op   = '+';
        if (*end == '-') {
            if (!kvp_tool_digits(end + 1, &end, last)) {
                throw std::invalid_argument(expect);
            }
            if (*end == '+' || *end == '*') {
                op = *end;
                if (!kvp_tool_digits(end + 1, &end, step)) {
                    throw std::invalid_argument(expect);
                }
            }
            if (last < first) {
                throw std::invalid_argument(flag + ": range " + item + " ends before it starts");
            }
            if (op == '+' ? step < 1 : step < 2 || first < 1) {
                throw std::invalid_argument(flag + ": range " + item + " does not advance (a step >= 1, a factor >= 2 from a first >= 1)");
            }
        }
        if (*end != '\0' || first < min_value) {
            throw std::invalid_argument(expect);
        }
        for (int64_t x = first; x <= last; x = op == '+' ? x + step : x*step) {
            if (res.size() == n_max) {
                throw std::invalid_argument(flag + ": more than " + std::to_string(n_max) + " values in '" + s + "'");
            }
            res.push_back((int32_t) x);
        }
        if (i1 == s.size()) {
            break;
        }
        i0 = i1 + 1;
    }
    return res;
}

// whether s is well-formed UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF)
static inline bool kvp_tool_is_utf8(const std::string & s) {
    size_t i = 0;
    while (i < s.size()) {
        const unsigned char c = (unsigned char) s[i];
        int      n   = 0;
        uint32_t cpt = 0;
        if (c < 0x80) {
            i += 1;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1; cpt = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2; cpt = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3; cpt = c & 0x07;
        } else {
            return false;
        }
        if (i + n >= s.size()) {
            return false;
        }
        for (int j = 1; j <= n; ++j) {
            const unsigned char d = (unsigned char) s[i + j];
            if ((d & 0xC0) != 0x80) {
                return false;
            }
            cpt = (cpt << 6) | (d & 0x3F);
        }
        const uint32_t min_cpt[4] = { 0, 0x80, 0x800, 0x10000 };
        if (cpt < min_cpt[n] || cpt > 0x10FFFF || (cpt >= 0xD800 && cpt <= 0xDFFF)) {
            return false;
        }
        i += n + 1;
    }
    return true;
}

// why a model path (-m) cannot be loaded, before llama.cpp's loader tries it ("" if it can be read)
static inline std::string kvp_tool_model_error(const std::string & path) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
        return "-m: " + path + " is a folder, not a GGUF file";
    }
    if (!std::ifstream(path)) {
        return "model file not found: " + path;
    }
    return "";
}

// the UTF-8 text of a prompt file (-f), without a byte-order mark, or an invalid_argument that names the file and
// what is wrong with it; read before any model loads
static inline std::string kvp_tool_read_text(const std::string & path) {
    if (path.empty()) {
        throw std::invalid_argument("-f: an empty path; give a text file, or leave -f out for random tokens");
    }
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
        throw std::invalid_argument("-f: " + path + " is a folder; give a text file");
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        throw std::invalid_argument("-f: cannot read " + path + ": " + std::strerror(errno));
    }
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) {
        text.erase(0, 3);
    }
    if (!kvp_tool_is_utf8(text)) {
        throw std::invalid_argument("-f: " + path + " is not UTF-8 text");
    }
    return text;
}

// n test tokens: the text's tokens repeated, or (no text) random tokens from seed, without control or
// end-of-generation tokens
static inline std::vector<llama_token> kvp_tool_tokens(const llama_vocab * vocab, const std::string & text, const std::string & text_file, uint32_t seed, size_t n) {
    std::vector<llama_token> base;
    if (!text_file.empty()) {
        base.resize(text.size() + 16);
        const int32_t k = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), base.data(), (int32_t) base.size(), false, false);
        if (k <= 0) {
            throw std::invalid_argument("-f: no tokens in " + text_file);
        }
        base.resize(k);
    } else {
        std::mt19937 rng(seed);
        const int32_t n_vocab = llama_vocab_n_tokens(vocab);
        std::uniform_int_distribution<int32_t> dist(0, n_vocab - 1);
        base.resize(std::max<size_t>(n, 1));
        for (auto & t : base) {
            do {
                t = dist(rng);
            } while (llama_vocab_is_control(vocab, t) || llama_vocab_is_eog(vocab, t));
        }
    }
    std::vector<llama_token> res(n);
    for (size_t i = 0; i < n; ++i) {
        res[i] = base[i % base.size()];
    }
    return res;
}

// decodes tokens at positions pos0.. of sequence 0 as a prompt in batches of n_batch (guided chunks first when
// guided); the logits of the last token only
static inline void kvp_tool_prefill(llama_context * ctx, const llama_token * tokens, int32_t n, int32_t pos0, int32_t n_batch, bool guided) {
    int32_t i0 = 0;
    if (guided && n > 1) {
        i0 = llama_kvp_prefill_guided(ctx, tokens, n, pos0);
        if (i0 < 0) {
            throw std::runtime_error(std::string("guided prefill failed: ") + llama_kvp_last_error());
        }
    }
    llama_batch batch = llama_batch_init(n_batch, 0, 1);
    for (; i0 < n; i0 += n_batch) {
        const int32_t m = std::min(n_batch, n - i0);
        batch.n_tokens = m;
        for (int32_t j = 0; j < m; ++j) {
            batch.token[j]     = tokens[i0 + j];
            batch.pos[j]       = pos0 + i0 + j;
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j]    = i0 + j == n - 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            llama_batch_free(batch);
            throw std::runtime_error("llama_decode failed at position " + std::to_string(pos0 + i0));
        }
    }
    llama_batch_free(batch);
}

// whether a TCP connection to host:port opens (within 5 s)
static inline bool kvp_tool_can_connect(const std::string & host, const std::string & port) {
#ifdef _WIN32
    (void) host; (void) port;
    return true; // ggml-rpc's own connection says it there
#else
    addrinfo hints = {};
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) {
        return false;
    }
    bool ok = false;
    for (addrinfo * a = res; a && !ok; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            continue;
        }
        timeval tv = { 5, 0 };
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        close(fd);
    }
    freeaddrinfo(res);
    return ok;
#endif
}

// registers the RPC servers of --rpc ("host:port[,host:port..]") as devices for the model, as llama-bench does;
// each is reached first, since ggml-rpc aborts the process on a server it cannot reach (throws with its name)
static inline void kvp_tool_add_rpc_servers(const std::string & servers) {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    auto add = reg ? (ggml_backend_reg_t (*)(const char *)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server") : nullptr;
    if (!add) {
        throw std::invalid_argument("--rpc: this build has no RPC backend (rebuild with -DGGML_RPC=ON)");
    }
    std::stringstream ss(servers);
    std::string ep;
    int32_t n = 0;
    while (std::getline(ss, ep, ',')) {
        if (ep.empty()) {
            continue;
        }
        const size_t colon = ep.rfind(':');
        if (colon == std::string::npos || colon == 0 || colon + 1 == ep.size() ||
            ep.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
            throw std::invalid_argument("--rpc: '" + ep + "' is not host:port");
        }
        if (!kvp_tool_can_connect(ep.substr(0, colon), ep.substr(colon + 1))) {
            throw std::invalid_argument("--rpc: RPC server " + ep + " cannot be reached; is `pykvcache rpc-server` running there?");
        }
        ggml_backend_reg_t r = add(ep.c_str());
        if (!r) {
            throw std::invalid_argument("--rpc: RPC server " + ep + " cannot be reached");
        }
        ggml_backend_register(r);
        n++;
    }
    if (n == 0) {
        throw std::invalid_argument("--rpc: no servers given (expected host:port[,host:port..])");
    }
}
