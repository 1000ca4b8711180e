# idemq: one static binary, run as a non-root user.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# The build context has no .git (.dockerignore), so Go stamps no commit: pass it (and, for
# a build that is no listed release, a version) or `idemq version` says devel. A commit
# that RELEASES lists names its version by itself. `make up` passes the commit.
ARG IDEMQ_VERSION=""
ARG IDEMQ_COMMIT=""
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w \
      -X github.com/idemq/idemq/internal/release.version=${IDEMQ_VERSION} \
      -X github.com/idemq/idemq/internal/release.commit=${IDEMQ_COMMIT}" \
    -o /out/idemq ./cmd/idemq

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/idemq /usr/local/bin/idemq
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/idemq"]
CMD ["help"]
