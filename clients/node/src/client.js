// KvgridClient: the public TextGeneration API of a kvgrid server (the tokenizer frontend).
import { readFileSync } from 'node:fs';

import * as grpc from '@grpc/grpc-js';

import { deltas, unary } from './deltas.js';
import { loadProtos } from './protos.js';

export const DEFAULT_ADDR = 'localhost:50051';
export const ADDR_ENV = 'KVGRID_ADDR';
export const API_KEY_ENV = 'KVGRID_API_KEY';
const CALL_KEYS = new Set(['signal', 'timeoutMs', 'requestId']);

export class KvgridClient {
  /**
   * @param {object} [options]
   * @param {string} [options.address] HOST:PORT of the frontend ($KVGRID_ADDR, else localhost:50051)
   * @param {string} [options.protoDir] directory holding kvgrid/v1/*.proto ($KVGRID_PROTO_DIR, else the repository's)
   * @param {string} [options.apiKey] API key of a server started with --api-key ($KVGRID_API_KEY), sent on every
   *   call as `authorization: Bearer <key>` metadata
   * @param {string} [options.caFile] connect with TLS, trusting this CA (PEM file); default: plaintext
   * @param {import('@grpc/grpc-js').ChannelCredentials} [options.credentials] instead of caFile (e.g. with a client
   *   certificate: grpc.credentials.createSsl(ca, key, cert)); default: insecure
   * @param {object} [options.channelOptions] grpc-js channel options
   */
  constructor({ address, protoDir, apiKey, caFile, credentials, channelOptions } = {}) {
    const { v1, samplingFields } = loadProtos(protoDir);
    this.address = address ?? process.env[ADDR_ENV] ?? DEFAULT_ADDR;
    this.samplingFields = new Set(samplingFields);
    const key = apiKey ?? process.env[API_KEY_ENV];
    this.#metadata = new grpc.Metadata();
    if (key) this.#metadata.set('authorization', `Bearer ${key}`);
    const tls = caFile ? grpc.credentials.createSsl(readFileSync(caFile)) : undefined;
    this.stub = new v1.TextGeneration(
      this.address,
      credentials ?? tls ?? grpc.credentials.createInsecure(),
      channelOptions,
    );
  }

  #metadata;

  /**
   * Completes `prompt` (text, or an array of token ids) and yields deltas
   * `{text, tokenIds, finishReason, usage, logprobs, requestId}`; the last one has finishReason
   * ("stop", "length" or "abort") and usage.
   *
   * `options`: any SamplingParams field in camelCase (maxTokens, temperature, topP, topK, minP, seed,
   * stop, stopTokenIds, ignoreEos, minTokens, presencePenalty, frequencyPenalty, repetitionPenalty,
   * logprobs, ...), plus `signal` (AbortSignal), `timeoutMs` and `requestId`.
   */
  generate(prompt, options = {}) {
    const request = Array.isArray(prompt) ? { promptTokenIds: prompt } : { prompt };
    return this.#stream('Generate', request, options);
  }

  /**
   * Completes a conversation `[{role, content}, ...]` with the model's chat template; yields like generate.
   * An assistant message may carry `toolCalls` (`[{id, type, function: {name, arguments}}]`), a tool message
   * its `toolCallId`. `options` may also hold `tools` (OpenAI's `[{type: 'function', function: {name,
   * description, parameters}}]`, parameters a JSON schema object), `toolChoice` ('auto', 'none', 'required' or
   * `{type: 'function', function: {name}}`) and `parallelToolCalls`; each delta's `toolCalls` then holds
   * pieces of the calls in OpenAI's shape and the last finishReason is 'tool_calls' when the answer is calls.
   */
  chat(messages, options = {}) {
    const { tools, toolChoice, parallelToolCalls, ...rest } = options;
    const request = { messages };
    if (tools !== undefined) request.tools = tools.map(protoTool);
    if (toolChoice !== undefined) request.toolChoice = protoToolChoice(toolChoice);
    if (parallelToolCalls !== undefined) request.parallelToolCalls = parallelToolCalls;
    return this.#stream('Chat', request, rest);
  }

  /** `{tokenIds, tokens}` of `text`, or of chat `messages` rendered with the template when given. */
  tokenize(text, { addSpecialTokens = false, messages, signal, timeoutMs } = {}) {
    const request = { text, addSpecialTokens, messages };
    return unary(this.stub, 'Tokenize', request, this.#metadata.clone(), callOptions(timeoutMs), signal);
  }

  /** The text of `tokenIds`. */
  async detokenize(tokenIds, { includeSpecialTokens = false, signal, timeoutMs } = {}) {
    const request = { tokenIds, includeSpecialTokens };
    return (await unary(this.stub, 'Detokenize', request, this.#metadata.clone(), callOptions(timeoutMs), signal)).text;
  }

  /** What is served: `{model, maxModelLen, vocabSize, numKvBlocks, blockSize, dtype, eosTokenIds, device}`. */
  getModelInfo({ signal, timeoutMs } = {}) {
    return unary(this.stub, 'GetModelInfo', {}, this.#metadata.clone(), callOptions(timeoutMs), signal);
  }

  close() {
    this.stub.close();
  }

  #stream(method, request, options) {
    const { signal, timeoutMs, requestId } = options;
    const full = { ...request, sampling: this.#sampling(options), requestId: requestId ?? '' };
    return deltas(() => this.stub[method](full, this.#metadata.clone(), callOptions(timeoutMs)), signal);
  }

  #sampling(options) {
    const sampling = {};
    for (const [key, value] of Object.entries(options)) {
      if (CALL_KEYS.has(key) || value === undefined) continue;
      if (!this.samplingFields.has(key)) {
        const known = [...this.samplingFields, ...CALL_KEYS].join(', ');
        throw new TypeError(`unknown option ${JSON.stringify(key)} (options: ${known})`);
      }
      sampling[key] = value;
    }
    return sampling;
  }
}

function protoTool({ type = 'function', function: fn }) {
  const { name, description = '', parameters } = fn;
  const schema = parameters === undefined ? '' : JSON.stringify(parameters);
  return { type, function: { name, description, parameters: schema } };
}

function protoToolChoice(choice) {
  return typeof choice === 'string' ? { mode: choice } : { mode: 'function', functionName: choice.function.name };
}

function callOptions(timeoutMs) {
  return timeoutMs === undefined ? {} : { deadline: Date.now() + timeoutMs };
}
