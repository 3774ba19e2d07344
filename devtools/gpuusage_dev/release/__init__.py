"""A release: the multi-arch images, checked for what they are, and what is published with them
(docs/development.md, "How a release is cut")."""
