// Reads one chat answer with the Vercel AI SDK's own client path, as useChat
// does: DefaultChatTransport posts the messages and parses the UI message
// stream, readUIMessageStream assembles the message and raises on an error
// part. Prints one JSON line: {"text", "tools"} when the stream ended, or
// {"error", "message", "text", "tools"} when the SDK raised (text and tools:
// what arrived before it; tools: each tool part's toolCallId, state and
// input as the SDK assembled it).
//
// Usage: node read_ui_message_stream.mjs URL '{"header": "value"}'
import { DefaultChatTransport, readUIMessageStream } from "ai";

const [url, headersJson] = process.argv.slice(2);
const transport = new DefaultChatTransport({ api: url, headers: JSON.parse(headersJson || "{}") });
let text = "";
let tools = [];
try {
  const chunks = await transport.sendMessages({
    chatId: "chat",
    messages: [{ id: "m1", role: "user", parts: [{ type: "text", text: "hi" }] }],
    trigger: "submit-message",
    messageId: undefined,
    abortSignal: undefined,
  });
  for await (const message of readUIMessageStream({ stream: chunks, terminateOnError: true })) {
    text = message.parts
      .filter((part) => part.type === "text")
      .map((part) => part.text)
      .join("");
    tools = message.parts
      .filter((part) => part.type.startsWith("tool-") || part.type === "dynamic-tool")
      .map((part) => ({ toolCallId: part.toolCallId, state: part.state, input: part.input }));
  }
  console.log(JSON.stringify({ text, tools }));
} catch (error) {
  const failed = { error: String(error?.name), message: String(error?.message), text, tools };
  console.log(JSON.stringify(failed));
}
